"""Low-rank adapters (LoRA) for the consumers' fine-tunes: attach, train, save, merge.

Kept tiny on purpose: the adapters are committed with the script that made them, and merged
into the producer's weights to build each consumer checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """``base(x) + scale * x @ A^T @ B^T`` with the base frozen and ``B`` initialised to zero."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        bound = 1.0 / math.sqrt(base.in_features)
        with torch.no_grad():
            self.lora_a.uniform_(-bound, bound, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def attach(model: nn.Module, rank: int, alpha: float, seed: int) -> dict[str, LoRALinear]:
    """Wrap every target linear layer of ``model`` in a LoRA layer; freeze everything else."""
    for param in model.parameters():
        param.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in TARGETS and isinstance(child, nn.Linear):
                lora = LoRALinear(child, rank, alpha, generator)
                setattr(module, child_name, lora)
                wrapped[f"{name}.{child_name}" if name else child_name] = lora
    if not wrapped:
        raise ValueError("no LoRA target layers found in the model")
    return wrapped


def adapter_state(wrapped: dict[str, LoRALinear]) -> dict[str, torch.Tensor]:
    """The adapter's tensors, named ``{layer}.lora_a`` / ``{layer}.lora_b``, in bf16."""
    state = {}
    for name, lora in wrapped.items():
        state[f"{name}.lora_a"] = lora.lora_a.detach().to(torch.bfloat16).contiguous()
        state[f"{name}.lora_b"] = lora.lora_b.detach().to(torch.bfloat16).contiguous()
    return state


def save_adapter(path: Path, wrapped: dict[str, LoRALinear], metadata: dict[str, str]) -> None:
    save_file(adapter_state(wrapped), str(path), metadata=metadata)


@torch.no_grad()
def merge_adapter(model: nn.Module, path: Path, scale: float) -> int:
    """Add ``scale * B @ A`` of each adapter layer into ``model``'s weights; return layers merged."""
    tensors = load_file(str(path))
    modules = dict(model.named_modules())
    merged = 0
    for key, lora_a in tensors.items():
        if not key.endswith(".lora_a"):
            continue
        name = key.removesuffix(".lora_a")
        if name not in modules or not isinstance(modules[name], nn.Linear):
            raise ValueError(f"adapter layer {name!r} has no matching linear layer in the model")
        weight = modules[name].weight
        lora_b = tensors[f"{name}.lora_b"]
        weight += (lora_b.float() @ lora_a.float()).to(weight.dtype) * scale
        merged += 1
    return merged
