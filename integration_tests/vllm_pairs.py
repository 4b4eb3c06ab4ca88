"""Material for the vLLM server tests: a PEFT LoRA adapter of the producer, and a quick bundle.

The adapter is a structural consumer (random low-rank updates of the attention projections, no
training): vLLM serves it by name on the base model's server, and the bundle's pair for it is
distilled on the merged weights, as a user's adapter would be.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from scd_store.adapters.transformers import LoadedModel
from scd_store.adapters.transformers.calibration import CalibrationConfig, distil_decoder, fit_space
from scd_store.codecs.scd.bundle import save_pair, save_space
from scd_store.models import catalog
from scd_store.models.fingerprint import tensors_fingerprint

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
QUICK = CalibrationConfig(budget=0.25, basis_windows=3, prefix_tokens=64, continuation_tokens=8, distill_windows=4,
                          distill_steps=4)


def make_lora_adapter(producer: LoadedModel, directory: Path, name: str, *, rank: int = 8, alpha: float = 16.0,
                      seed: int = 0, scale: float = 0.02) -> LoadedModel:
    """Write a PEFT LoRA adapter of ``producer`` to ``directory``; return the merged model named ``name``."""
    generator = torch.Generator().manual_seed(seed)
    merged = copy.deepcopy(producer.model)
    tensors: dict[str, torch.Tensor] = {}
    for module_name, module in merged.named_modules():
        leaf = module_name.rsplit(".", 1)[-1]
        if leaf not in TARGETS:
            continue
        a = torch.randn(rank, module.in_features, generator=generator) * scale
        b = torch.randn(module.out_features, rank, generator=generator) * scale
        with torch.no_grad():
            module.weight += (alpha / rank) * b @ a
        tensors[f"base_model.model.{module_name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module_name}.lora_B.weight"] = b.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(TARGETS), "base_model_name_or_path": catalog.PRODUCER}))
    return LoadedModel(name, merged, producer.tokenizer, tensors_fingerprint(merged.state_dict()))


def quick_bundle(producer: LoadedModel, consumers: list[LoadedModel], path: Path, space_id: str) -> Path:
    """A bundle with a quickly fitted space and a briefly distilled decoder per consumer (structure, not quality)."""
    space = fit_space(producer, ["shakespeare"], QUICK, space_id, progress=False)
    save_space(path, space, extra={"producer": catalog.PRODUCER})
    for consumer in consumers:
        decoder, _ = distil_decoder(producer, consumer, space, "shakespeare", QUICK, progress=False)
        save_pair(path, decoder)
    return path
