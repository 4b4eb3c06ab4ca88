"""Bits over a calibrated basis: per-component uniform quantisers, greedy bit allocation, bit packing.

Each code component ``j`` (a coordinate in a layer's PCA basis) gets ``b_j`` bits (0..8) and a
uniform mid-rise quantiser with step ``STEP[b_j] * sigma_j``, where ``sigma_j`` is the component's
calibration standard deviation and ``STEP`` the step that minimises MSE for a unit Gaussian.
Zero bits means the component is not sent (decoded as its mean). Allocation is reverse
water-filling done greedily: each extra bit goes where it removes the most weighted distortion.
"""

from __future__ import annotations

import heapq

import torch

MAX_BITS = 8
# MSE-optimal uniform quantiser step for a unit Gaussian, and its distortion, by bit count (Max 1960).
STEP = (0.0, 1.596, 0.9957, 0.5860, 0.3352, 0.1881, 0.1041, 0.0569, 0.0308)
DISTORTION = (1.0, 0.3634, 0.1188, 0.03744, 0.01154, 0.003495, 0.001040, 0.0003060, 0.0000891)


def allocate_bits(variances: torch.Tensor, weights: torch.Tensor, total_bits: int) -> torch.Tensor:
    """Spread ``total_bits`` over components (flattened) to minimise ``sum w_j var_j D(b_j)``.

    Returns an int tensor shaped like ``variances`` with values in 0..8.
    """
    if variances.shape != weights.shape:
        raise ValueError("variances and weights must have the same shape")
    flat = (variances * weights).flatten().double().tolist()
    bits = [0] * len(flat)
    heap = [(-(v * (DISTORTION[0] - DISTORTION[1])), j) for j, v in enumerate(flat) if v > 0]
    heapq.heapify(heap)
    budget = int(total_bits)
    while budget > 0 and heap:
        _, j = heapq.heappop(heap)
        bits[j] += 1
        budget -= 1
        b = bits[j]
        if b < MAX_BITS:
            heapq.heappush(heap, (-(flat[j] * (DISTORTION[b] - DISTORTION[b + 1])), j))
    return torch.tensor(bits, dtype=torch.int64).reshape(variances.shape)


def quantize(z: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) of ``z`` ``[T, n]`` for per-column ``sigma`` ``[n]`` and ``bits`` ``[n]``."""
    step = torch.tensor(STEP, dtype=z.dtype, device=z.device)[bits] * sigma
    levels = (1 << bits).to(z.dtype)
    q = torch.floor(z / step.clamp_min(1e-12)) + levels / 2
    q = torch.minimum(q.clamp_min(0), levels - 1)
    return torch.where(bits > 0, q, torch.zeros_like(q)).to(torch.uint8)


def dequantize(codes: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """Reconstruction (mid-points) of :func:`quantize`; zero where a component has no bits."""
    step = torch.tensor(STEP, dtype=dtype, device=codes.device)[bits] * sigma.to(dtype)
    levels = (1 << bits).to(dtype)
    z = (codes.to(dtype) - levels / 2 + 0.5) * step
    return torch.where(bits > 0, z, torch.zeros_like(z))


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack_codes(codes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Pack ``codes`` ``[T, n]`` using ``bits[j]`` bits for column ``j``; returns a flat uint8 tensor.

    Columns are grouped by width (8, 7, ..., 1); within a group, bit planes are written
    little-endian per value, row-major. :func:`unpack_codes` inverts it given ``T`` and ``bits``.
    """
    shifts = _SHIFTS.to(codes.device)
    chunks = []
    for width in range(MAX_BITS, 0, -1):
        cols = (bits == width).nonzero().flatten()
        if cols.numel() == 0:
            continue
        planes = (codes[:, cols].unsqueeze(-1) >> shifts[:width]) & 1  # [T, n_w, width]
        chunks.append(planes.flatten())
    if not chunks:
        return torch.empty(0, dtype=torch.uint8, device=codes.device)
    flat = torch.cat(chunks)
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % 8)])
    return (flat.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


def packed_size(tokens: int, bits: torch.Tensor) -> int:
    """Bytes :func:`pack_codes` produces for ``tokens`` rows."""
    return (tokens * int(bits.sum()) + 7) // 8


def unpack_codes(packed: torch.Tensor, tokens: int, bits: torch.Tensor) -> torch.Tensor:
    """Invert :func:`pack_codes`: codes ``[tokens, n]`` (uint8; zero for 0-bit columns)."""
    if packed.numel() != packed_size(tokens, bits):
        raise ValueError(f"packed codes hold {packed.numel()} bytes, expected {packed_size(tokens, bits)}")
    shifts = _SHIFTS.to(packed.device)
    flat = ((packed.unsqueeze(-1) >> shifts) & 1).flatten()
    codes = torch.zeros(tokens, bits.numel(), dtype=torch.uint8, device=packed.device)
    offset = 0
    for width in range(MAX_BITS, 0, -1):
        cols = (bits == width).nonzero().flatten()
        if cols.numel() == 0:
            continue
        count = tokens * cols.numel() * width
        planes = flat[offset:offset + count].view(tokens, cols.numel(), width)
        codes[:, cols] = (planes << shifts[:width]).sum(dim=-1, dtype=torch.uint8)
        offset += count
    return codes
