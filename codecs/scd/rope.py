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


class RopeTable:
    """``cos`` / ``sin`` for positions ``0..n`` computed once per device and dtype and sliced per call
    (decoding the same prefix lengths again and again must not recompute the angles)."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta = head_dim, theta
        self._tables: dict[tuple[str, torch.dtype], tuple[torch.Tensor, ...]] = {}

    def _table(self, end: int, device: torch.device | str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        key = (str(device), dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < end:
            size = max(1024, 1 << (end - 1).bit_length())
            cos, sin = rope_cos_sin(torch.arange(size, device=device), self.head_dim, self.theta, dtype=dtype)
            half = self.head_dim // 2
            table = (cos, sin, cos[:, :half].contiguous(), sin[:, :half].contiguous())
            self._tables[key] = table
        return table

    def get(self, start: int, length: int, device: torch.device | str, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[length, head_dim]`` for positions ``start..start + length``."""
        cos, sin, _, _ = self._table(start + length, device, dtype)
        return cos[start:start + length], sin[start:start + length]

    def halves(self, start: int, length: int, device: torch.device | str, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first halves of :meth:`get` (``[length, head_dim / 2]``, both halves of a row are
        equal): what :func:`rotate_into` reads."""
        _, _, cos, sin = self._table(start + length, device, dtype)
        return cos[start:start + length], sin[start:start + length]


def rotate_into(out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` of ``keys`` (any strides) written into ``out`` without temporaries of the
    rotated halves; ``cos`` / ``sin`` are the half tables ``[T, head_dim / 2]`` of :meth:`RopeTable.halves`."""
    half = keys.shape[-1] // 2
    k1, k2 = keys[..., :half], keys[..., half:]
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(k1, cos, out=o1)
    o1.addcmul_(k2, sin, value=-1.0)
    torch.mul(k2, cos, out=o2)
    o2.addcmul_(k1, sin)
    return out
