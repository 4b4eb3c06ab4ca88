"""``scd-store models train``: re-create a consumer's committed adapter from its recipe."""

from __future__ import annotations

import torch

from scd_store.models import catalog
from scd_store.models.finetune import train_adapter
from scd_store.models.prepare import load_local, prepare_producer, read_manifest


def train_consumer(name: str, device: str = "cpu") -> dict:
    """Fine-tune the producer per the consumer's recipe and write its adapter into the package."""
    spec = catalog.consumer(name)
    producer_path = prepare_producer()
    torch.manual_seed(spec.recipe.seed)
    model, tokenizer = load_local(producer_path)
    spec.adapter_path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"consumer": name, "producer_fingerprint": read_manifest(producer_path)["weights_fingerprint"]}
    return train_adapter(model, tokenizer, spec.recipe, spec.adapter_path, metadata, device=device)
