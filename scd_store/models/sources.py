"""Where a model comes from: a catalog name, a local checkpoint directory, or a PEFT LoRA adapter on a base.

A model spec is ``NAME``, ``PATH`` or ``NAME=PATH``. A directory with ``config.json`` is a Hugging Face
checkpoint; one with ``adapter_config.json`` is a PEFT adapter, merged onto the producer for
calibration. The name is what bundles, the registry and engines call the model: an adapter's should
be the name the engine serves it under (vLLM's ``--lora-modules NAME=PATH``).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from scd_store.errors import ScdStoreError
from scd_store.models import catalog
from scd_store.models.prepare import MANIFEST, model_dir, read_manifest

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ADAPTER_CONFIG = "adapter_config.json"


class ModelSpecError(ScdStoreError, ValueError):
    """A model spec that names nothing loadable, or a consumer that does not fit its producer."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A loadable model: a checkpoint directory, plus a PEFT adapter directory merged onto it."""

    name: str
    path: Path
    adapter: Path | None = None

    def __post_init__(self) -> None:
        if not NAME.match(self.name):
            raise ModelSpecError(f"model name {self.name!r} must be letters, digits, '.', '_' or '-' "
                                 "(it names files and registry entries); give NAME=PATH")

    @property
    def in_catalog(self) -> bool:
        return self.adapter is None and self.name in catalog.ALL_MODELS


def _checkpoint_name(path: Path) -> str:
    if (path / MANIFEST).exists():
        return str(read_manifest(path).get("name") or path.name)
    return path.name


def resolve(spec: str, base: ModelSource | None = None) -> ModelSource:
    """The model a spec names; ``base`` is what a PEFT adapter is merged onto (the producer)."""
    name, sep, raw = spec.partition("=")
    if not sep:
        name, raw = "", spec
    path = Path(raw).expanduser()
    if path.is_dir() and (path / ADAPTER_CONFIG).is_file():
        if base is None:
            raise ModelSpecError(f"{path} is a PEFT adapter: it needs a base model (the producer)")
        _check_adapter(path)
        return ModelSource(name or path.name, base.path, path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name or _checkpoint_name(path), path)
    if path.exists() or "/" in raw:
        raise ModelSpecError(f"{raw}: not a checkpoint directory (no config.json) nor a PEFT adapter "
                             f"(no {ADAPTER_CONFIG})")
    try:
        directory = model_dir(raw)
    except KeyError as exc:
        raise ModelSpecError(str(exc.args[0])) from None
    return ModelSource(name or raw, directory)


def _check_adapter(path: Path) -> None:
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except ValueError as exc:
        raise ModelSpecError(f"{path / ADAPTER_CONFIG}: not JSON ({exc})") from None
    kind = config.get("peft_type") if isinstance(config, dict) else None
    if kind != "LORA":
        raise ModelSpecError(f"{path}: a {kind!r} adapter; only PEFT LoRA adapters are merged")
    if not (path / "adapter_model.safetensors").is_file():
        if (path / "adapter_model.bin").is_file():
            raise ModelSpecError(f"{path}: only a pickled adapter_model.bin; scd-store loads safetensors only")
        raise ModelSpecError(f"{path}: no adapter_model.safetensors")


# what must agree between a producer and a consumer for the consumer to read the producer's codes
_SHARED = ("model_type", "num_hidden_layers", "num_key_value_heads", "hidden_size", "num_attention_heads",
           "head_dim", "vocab_size", "rope_parameters", "rope_scaling", "rope_theta", "sliding_window",
           "layer_types", "partial_rotary_factor")


@functools.cache
def tokenizer_of(path: Path):  # noqa: ANN201 - a transformers tokenizer
    """The tokenizer of the checkpoint at ``path``, read once per process (pre-flight checks share it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@functools.cache
def _config(path: Path) -> dict:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path)).to_dict()


def check_pair(producer: ModelSource, consumer: ModelSource) -> None:
    """Raise :class:`ModelSpecError` unless ``consumer`` has ``producer``'s architecture and tokenizer
    (read from the config and tokenizer files: no weights are loaded)."""
    if consumer.adapter is not None:
        return  # merged onto the producer itself
    configs = [_config(m.path) for m in (producer, consumer)]
    differ = [k for k in _SHARED if configs[0].get(k) != configs[1].get(k)]
    if differ:
        details = ", ".join(f"{k}: {configs[0].get(k)!r} vs {configs[1].get(k)!r}" for k in differ)
        raise ModelSpecError(f"consumer {consumer.name} does not fit producer {producer.name}'s architecture "
                             f"({details}): a consumer must be a fine-tune of the producer")
    probe = "The quick brown fox: def main(): return 42 \u00e9\u4e2d"
    tokenizers = [tokenizer_of(m.path) for m in (producer, consumer)]
    if tokenizers[0].get_vocab() != tokenizers[1].get_vocab() or \
            tokenizers[0](probe)["input_ids"] != tokenizers[1](probe)["input_ids"]:
        raise ModelSpecError(f"consumer {consumer.name} tokenizes text differently from producer {producer.name}: "
                             "it cannot read the producer's cache")
