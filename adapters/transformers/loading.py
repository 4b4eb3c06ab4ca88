"""Load a catalog model or any local Hugging Face checkpoint directory (safetensors), offline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from scd_store.models.fingerprint import tensors_fingerprint
from scd_store.models.prepare import MANIFEST, load_local, model_dir, read_manifest


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


def load_model(name_or_path: str, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load by catalog name (prepared under the data dir) or by checkpoint directory path."""
    path = Path(model_dir(name_or_path))
    model, tokenizer = load_local(path, dtype=dtype)
    model.to(device)
    if (path / MANIFEST).exists():
        manifest = read_manifest(path)
        return LoadedModel(manifest["name"], model, tokenizer, manifest["weights_fingerprint"])
    return LoadedModel(path.name, model, tokenizer, tensors_fingerprint(model.state_dict()))
