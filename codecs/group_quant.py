"""Asymmetric min/max group quantisation along one axis (the building block of KIVI-style codecs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (2, 4, 8)


@dataclass(slots=True)
class Quantized:
    """Codes (uint8; ``8 / bits`` codes per byte below 8 bits) with fp16 scale and offset per group."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor


def quantize(x: torch.Tensor, axis: int, group: int, bits: int) -> Quantized:
    """Quantise ``x`` in groups of ``group`` consecutive elements along ``axis``.

    The axis is padded (by repeating its last element) to a multiple of ``group``; the result's
    group dimension is last: ``codes`` is ``[..., groups, group]`` (halved when packed).
    """
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if group <= 0 or group % (8 // bits):
        raise ValueError(f"group must be a positive multiple of {8 // bits} for {bits}-bit codes, got {group}")
    xt = x.float().movedim(axis, -1)
    n = xt.shape[-1]
    pad = (-n) % group
    if pad:
        xt = torch.cat([xt, xt[..., -1:].expand(*xt.shape[:-1], pad)], dim=-1)
    xg = xt.reshape(*xt.shape[:-1], -1, group)
    levels = (1 << bits) - 1
    lo = xg.amin(dim=-1, keepdim=True).half()
    hi = xg.amax(dim=-1, keepdim=True)
    scale = ((hi - lo.float()) / levels).clamp_min(1e-8).half()
    codes = ((xg - lo.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    per_byte = 8 // bits
    if per_byte > 1:
        packed = codes[..., 0::per_byte].clone()
        for i in range(1, per_byte):
            packed |= codes[..., i::per_byte] << (i * bits)
        codes = packed
    return Quantized(codes.contiguous(), scale.squeeze(-1).contiguous(), lo.squeeze(-1).contiguous())


def dequantize(q: Quantized, axis: int, length: int, bits: int, ndim: int) -> torch.Tensor:
    """Invert :func:`quantize`: a float32 tensor with ``length`` elements along ``axis``."""
    codes = q.codes
    per_byte = 8 // bits
    if per_byte > 1:
        mask = (1 << bits) - 1
        codes = torch.stack([(codes >> (i * bits)) & mask for i in range(per_byte)], dim=-1)
        codes = codes.reshape(*codes.shape[:-2], -1)
    x = codes.float() * q.scale.float().unsqueeze(-1) + q.offset.float().unsqueeze(-1)
    x = x.reshape(*x.shape[:-2], -1)[..., :length]
    return x.movedim(-1, axis % ndim)
