"""Load a catalog model, any local Hugging Face checkpoint directory (safetensors), or a PEFT LoRA
adapter merged onto its base, offline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from scd_store.models.fingerprint import tensors_fingerprint
from scd_store.models.prepare import MANIFEST, load_local, model_dir, read_manifest
from scd_store.models.sources import ModelSource


@dataclass(slots=True)
class LoadedModel:
    """A causal LM ready for the runner: model, tokenizer, name and weights fingerprint."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    fingerprint: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers


def load_model(name_or_path: str | ModelSource, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load by catalog name (prepared under the data dir), checkpoint directory path or :class:`ModelSource`
    (a PEFT adapter is merged into its base's weights with PEFT's own ``merge_and_unload``). The weights'
    fingerprint is the prepared manifest's when one describes them, else computed."""
    source = name_or_path if isinstance(name_or_path, ModelSource) else None
    path = source.path if source is not None else Path(model_dir(name_or_path))
    manifest = read_manifest(path) if (path / MANIFEST).exists() else None
    model, tokenizer = load_local(path, dtype=dtype)
    if source is not None and source.adapter is not None:
        model, manifest = merge_peft_adapter(model, source.adapter), None
    model.to(device)
    name = source.name if source is not None else manifest["name"] if manifest else path.name
    fingerprint = manifest["weights_fingerprint"] if manifest else tensors_fingerprint(model.state_dict())
    return LoadedModel(name, model, tokenizer, fingerprint)


def merge_peft_adapter(model: torch.nn.Module, adapter: Path) -> torch.nn.Module:
    """``model`` with the PEFT LoRA adapter at ``adapter`` merged into its weights (safetensors only)."""
    try:
        from peft import PeftModel
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"{adapter} is a PEFT adapter; loading it needs peft: "
                                  "pip install 'scd-store[adapters]'", name="peft") from exc

    merged = PeftModel.from_pretrained(model, str(adapter), use_safetensors=True).merge_and_unload()
    merged.eval()
    return merged
