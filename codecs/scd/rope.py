"""Rotary position embedding (Llama's default "rotate half" form) for keys, and its exact inverse.

Codes are kept position-independent: keys are un-rotated to pre-RoPE before coding and rotated
at their target positions after decoding.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` of shape ``[T, head_dim]`` for integer ``positions`` ``[T]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``keys`` ``[..., T, head_dim]`` to their positions."""
    return keys * cos + _rotate_half(keys) * sin


def invert_rope(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo :func:`apply_rope` (rotation by the negative angle)."""
    return keys * cos - _rotate_half(keys) * sin
