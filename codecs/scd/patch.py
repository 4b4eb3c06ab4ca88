"""PATCH: at a few layers, the consumer's K and V are regenerated with its own projections.

A patch aligner at layer ``l`` maps an input ``x`` to a hidden-size vector ``h`` and turns it into
pre-RoPE keys and values with the consumer's own ``W_k`` / ``W_v`` (and biases)::

    source "hidden":  x = the producer's H_in at l (decoded from its code)
                      h = x + relu(x A + a) B                      K = h W_k^T + b_k,  V = h W_v^T + b_v
    source "kv":      x = [K_reuse | V_reuse], the REUSE decoder's output at l (no extra payload)
                      h = relu(x A + a) B                          K = K_reuse + h W_k^T, V = V_reuse + h W_v^T

``B`` starts at zero, so a "kv" aligner starts exactly at REUSE and a "hidden" aligner at the
consumer's projection of the producer's normalised input. Aligners are trained end to end with the
REUSE maps (distillation on the consumer's next-token distribution), never on reconstruction MSE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SOURCES = ("hidden", "kv")


@dataclass(slots=True)
class PatchAligner:
    """One patch layer's aligner and the consumer's projections it feeds."""

    layer: int
    source: str
    w_in: torch.Tensor  # [D_in, hidden_units]
    b_in: torch.Tensor  # [hidden_units]
    w_out: torch.Tensor  # [hidden_units, hidden_size]
    k_proj: torch.Tensor  # [C, hidden_size]: the consumer's W_k at this layer
    v_proj: torch.Tensor  # [C, hidden_size]
    k_bias: torch.Tensor  # [C]
    v_bias: torch.Tensor  # [C]

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"patch source must be one of {SOURCES}, got {self.source!r}")
        units, hidden = self.w_out.shape
        width = self.k_proj.shape[0]
        d_in = hidden if self.source == "hidden" else 2 * width
        expected = {"w_in": (d_in, units), "b_in": (units,), "k_proj": (width, hidden), "v_proj": (width, hidden),
                    "k_bias": (width,), "v_bias": (width,)}
        for name, shape in expected.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"patch aligner {name} has shape {tuple(getattr(self, name).shape)}, expected {shape}")

    @classmethod
    def initial(cls, layer: int, source: str, attention: torch.nn.Module, units: int, seed: int) -> PatchAligner:
        """A fresh aligner for ``attention`` (a Llama attention module of the consumer): ``B = 0``."""
        if not hasattr(attention, "k_proj") or not hasattr(attention, "v_proj"):
            raise ValueError(f"PATCH needs separate k_proj / v_proj; {type(attention).__name__} fuses them: "
                             "calibrate REUSE only (--patch-layers 0)")
        if getattr(attention, "k_norm", None) is not None:
            raise ValueError(f"PATCH regenerates keys as k_proj(x); {type(attention).__name__} normalises keys "
                             "(k_norm): calibrate REUSE only (--patch-layers 0)")
        k_proj, v_proj = attention.k_proj, attention.v_proj
        width, hidden = k_proj.weight.shape
        d_in = hidden if source == "hidden" else 2 * width
        generator = torch.Generator().manual_seed(seed * 1000 + layer)
        w_in = torch.randn(d_in, units, generator=generator) / d_in ** 0.5

        def bias(linear: torch.nn.Linear) -> torch.Tensor:
            return linear.bias.detach().float().cpu().clone() if linear.bias is not None else torch.zeros(width)

        return cls(layer, source, w_in, torch.zeros(units), torch.zeros(units, hidden),
                   k_proj.weight.detach().float().cpu().clone(), v_proj.weight.detach().float().cpu().clone(),
                   bias(k_proj), bias(v_proj))

    def trainable(self) -> list[torch.Tensor]:
        return [self.w_in, self.b_in, self.w_out]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"w_in": self.w_in, "b_in": self.b_in, "w_out": self.w_out, "k_proj": self.k_proj,
                "v_proj": self.v_proj, "k_bias": self.k_bias, "v_bias": self.v_bias}

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> PatchAligner:
        moved = {k: v.detach().to(device=device, dtype=dtype) for k, v in self.tensors().items()}
        return PatchAligner(self.layer, self.source, **moved)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE keys and values ``[..., C]`` from ``x`` ``[..., D_in]`` (differentiable)."""
        h = torch.relu(x @ self.w_in + self.b_in) @ self.w_out
        if self.source == "hidden":
            h = h + x
            return h @ self.k_proj.T + self.k_bias, h @ self.v_proj.T + self.v_bias
        width = self.k_proj.shape[0]
        return x[..., :width] + h @ self.k_proj.T, x[..., width:] + h @ self.v_proj.T


def aligned_kv(patch: PatchAligner, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor | None,
               hidden_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``patch``'s K / V features for its layer from what it reads: the decoded ``H_in`` (``hidden``
    ``[..., P, D]`` at ``hidden_layers``) or the layer's REUSE ``keys`` / ``values`` ``[..., C]``."""
    if patch.source == "hidden":
        return patch(hidden[..., hidden_layers.index(patch.layer), :])
    return patch(torch.cat([keys, values], dim=-1))


def apply_patches(groups: list[torch.Tensor], patches: list[PatchAligner], hidden: torch.Tensor | None,
                  hidden_layers: tuple[int, ...]) -> None:
    """Replace, in ``groups`` (one ``[..., C]`` tensor per K / V group), the patch layers' entries by
    their aligners' output (:func:`aligned_kv`, which decoding calls too, so both feed the aligners
    the same inputs)."""
    for patch in patches:
        layer = patch.layer
        groups[2 * layer], groups[2 * layer + 1] = aligned_kv(patch, groups[2 * layer], groups[2 * layer + 1],
                                                              hidden, hidden_layers)
