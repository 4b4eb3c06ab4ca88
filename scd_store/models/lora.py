"""Adapters for the consumers' fine-tunes: LoRA layers plus optional full-rank deltas.

An adapter file holds, per LoRA layer, ``{layer}.lora_a`` / ``{layer}.lora_b`` and, per parameter
trained at full rank (e.g. the K / V projections and the RMSNorm gains), ``{param}.delta`` = trained
minus initial weight. Kept small on purpose: adapters are committed with the script that made
them, and merged into the producer's weights to build each consumer checkpoint. A path ending in
``.packed`` is read and written in the lossless packed form (:mod:`scd_store.models.packed`), as the
committed adapters are kept.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from scd_store.models.packed import load_tensors, save_tensors

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


def attach(model: nn.Module, rank: int, alpha: float, seed: int, full: tuple[str, ...] = ()
           ) -> dict[str, LoRALinear]:
    """Wrap every target linear layer of ``model`` not named in ``full`` in a LoRA layer (none when
    ``rank`` is 0); freeze everything else (see :func:`unfreeze_full` for the full-rank part)."""
    for param in model.parameters():
        param.requires_grad_(False)
    wrapped: dict[str, LoRALinear] = {}
    if rank == 0:
        return wrapped
    generator = torch.Generator().manual_seed(seed)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in TARGETS and child_name not in full and isinstance(child, nn.Linear):
                lora = LoRALinear(child, rank, alpha, generator)
                setattr(module, child_name, lora)
                wrapped[f"{name}.{child_name}" if name else child_name] = lora
    if not wrapped:
        raise ValueError("no LoRA target layers found in the model")
    return wrapped


def _layer_index(parts: list[str]) -> int | None:
    """The decoder layer a parameter belongs to (``model.layers.<i>.``), None outside the layers."""
    if "layers" in parts:
        position = parts.index("layers") + 1
        if position < len(parts) and parts[position].isdigit():
            return int(parts[position])
    return None


def unfreeze_full(model: nn.Module, full: tuple[str, ...], first_layers: int = 0
                  ) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
    """Make parameters trainable at full rank: those of modules named in ``full`` (``"k_proj"``, or
    ``"norm"`` for every RMSNorm gain), only in decoder layers ``0 .. first_layers - 1`` when
    ``first_layers`` > 0. Returns ``{param name: (param, copy of its initial value)}``."""
    chosen: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}
    layers = {_layer_index(name.split(".")) for name, _ in model.named_parameters()} - {None}
    if first_layers > len(layers):
        raise ValueError(f"full_layers={first_layers} but the model has {len(layers)} decoder layers")
    for name, param in model.named_parameters():
        parts = name.split(".")
        module = parts[-2] if len(parts) > 1 else ""
        layer = _layer_index(parts)
        if first_layers > 0 and (layer is None or layer >= first_layers):
            continue
        is_norm = "norm" in full and module.endswith("norm")
        if module in full or is_norm:
            param.requires_grad_(True)
            chosen[name] = (param, param.detach().clone())
    if full and not chosen:
        raise ValueError(f"no parameters match the full-rank targets {full}")
    return chosen


DELTA_FORMATS = ("bf16", "int8")


def quantize_rows(delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of a weight delta: ``(codes int8, scales fp32 [rows])``."""
    rows = delta.float().reshape(delta.shape[0], -1)
    scale = rows.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    codes = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(delta.shape).contiguous(), scale.contiguous()


def adapter_state(wrapped: dict[str, LoRALinear], full: dict[str, tuple[nn.Parameter, torch.Tensor]] | None = None,
                  delta_format: str = "bf16") -> dict[str, torch.Tensor]:
    """The adapter's tensors: ``{layer}.lora_a`` / ``.lora_b`` in bf16 and, per full-rank parameter,
    ``{param}.delta`` (bf16) or ``{param}.delta_int8`` + ``{param}.delta_scale`` (per-row int8;
    1-D parameters such as norm gains always stay bf16)."""
    if delta_format not in DELTA_FORMATS:
        raise ValueError(f"delta format must be one of {DELTA_FORMATS}, got {delta_format!r}")
    state = {}
    for name, lora in wrapped.items():
        state[f"{name}.lora_a"] = lora.lora_a.detach().to(torch.bfloat16).contiguous()
        state[f"{name}.lora_b"] = lora.lora_b.detach().to(torch.bfloat16).contiguous()
    for name, (param, initial) in (full or {}).items():
        delta = (param.detach() - initial).cpu()
        if delta_format == "int8" and delta.dim() >= 2:
            state[f"{name}.delta_int8"], state[f"{name}.delta_scale"] = quantize_rows(delta)
        else:
            state[f"{name}.delta"] = delta.to(torch.bfloat16).contiguous()
    return state


def save_adapter(path: Path, wrapped: dict[str, LoRALinear], metadata: dict[str, str],
                 full: dict[str, tuple[nn.Parameter, torch.Tensor]] | None = None, delta_format: str = "bf16") -> None:
    save_tensors(adapter_state(wrapped, full, delta_format), path, metadata=metadata)


@torch.no_grad()
def merge_adapter(model: nn.Module, path: Path, scale: float) -> int:
    """Add ``scale * B @ A`` of each LoRA layer and each full-rank ``delta`` into ``model``'s weights;
    return the number of tensors merged."""
    tensors = load_tensors(path)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    merged = 0
    for key, tensor in tensors.items():
        if key.endswith((".delta", ".delta_int8")):
            name = key.removesuffix(".delta_int8").removesuffix(".delta")
            if key.endswith("_int8"):
                scale = tensors[f"{name}.delta_scale"]
                tensor = tensor.float() * scale.reshape(-1, *([1] * (tensor.dim() - 1)))
            if name not in params or params[name].shape != tensor.shape:
                raise ValueError(f"adapter delta {name!r} has no matching parameter in the model")
            params[name] += tensor.to(params[name].dtype)
            merged += 1
            continue
        if not key.endswith(".lora_a"):
            continue
        name = key.removesuffix(".lora_a")
        if name not in modules or not isinstance(modules[name], nn.Linear):
            raise ValueError(f"adapter layer {name!r} has no matching linear layer in the model")
        weight = modules[name].weight
        lora_b = tensors[f"{name}.lora_b"]
        weight += (lora_b.float() @ tensor.float()).to(weight.dtype) * scale
        merged += 1
    return merged
