"""Asymmetric min/max group quantisation along one axis (the building block of KIVI-style codecs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Quantized:
    """Codes (uint8; two 4-bit codes per byte when ``bits == 4``) with fp16 scale and offset per group."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor


def quantize(x: torch.Tensor, axis: int, group: int, bits: int) -> Quantized:
    """Quantise ``x`` in groups of ``group`` consecutive elements along ``axis``.

    The axis is padded (by repeating its last element) to a multiple of ``group``; the result's
    group dimension is last: ``codes`` is ``[..., groups, group]`` (halved when packed).
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group <= 0 or group % 2:
        raise ValueError(f"group must be a positive even number, got {group}")
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
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return Quantized(codes.contiguous(), scale.squeeze(-1).contiguous(), lo.squeeze(-1).contiguous())


def dequantize(q: Quantized, axis: int, length: int, bits: int, ndim: int) -> torch.Tensor:
    """Invert :func:`quantize`: a float32 tensor with ``length`` elements along ``axis``."""
    codes = q.codes
    if bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1)
    x = codes.float() * q.scale.float().unsqueeze(-1) + q.offset.float().unsqueeze(-1)
    x = x.reshape(*x.shape[:-2], -1)[..., :length]
    return x.movedim(-1, axis % ndim)
