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


# A w-bit code is stored as power-of-two fields (7 = 4 + 2 + 1 bits, high bits first), each field
# array packed 8 / p values per byte, so unpacking is a few shifts and masks per byte.
_FIELDS = {w: tuple(p for p in (8, 4, 2, 1) if w & p) for w in range(1, MAX_BITS + 1)}


def _field_layout(bits: torch.Tensor) -> list[tuple[torch.Tensor, int, int]]:
    """``(columns, width, part)`` triples in storage order: widths 8..1, parts high to low."""
    layout = []
    for width in range(MAX_BITS, 0, -1):
        cols = (bits == width).nonzero().flatten()
        if cols.numel():
            layout.extend((cols, width, part) for part in _FIELDS[width])
    return layout


def _part_shift(width: int, part: int) -> int:
    """Bit offset of ``part`` inside a ``width``-bit code (parts are laid out high to low)."""
    parts = _FIELDS[width]
    return sum(parts[parts.index(part) + 1:])


def packed_size(tokens: int, bits: torch.Tensor) -> int:
    """Bytes :func:`pack_codes` produces for ``tokens`` rows."""
    total = 0
    for cols, _, part in _field_layout(bits.cpu()):
        per_byte = 8 // part
        total += -(-tokens * cols.numel() // per_byte)
    return total


def pack_codes(codes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Pack ``codes`` ``[T, n]`` (uint8) using ``bits[j]`` bits for column ``j``; a flat uint8 tensor.

    Fields are stored component-major (all tokens of one column together), so unpacking writes
    whole contiguous rows of the component-major code matrix.
    """
    chunks = []
    for cols, width, part in _field_layout(bits.cpu()):
        field = (codes[:, cols.to(codes.device)].t() >> _part_shift(width, part)) & ((1 << part) - 1)
        chunks.append(_pack_field(field.flatten(), part))
    if not chunks:
        return torch.empty(0, dtype=torch.uint8, device=codes.device)
    return torch.cat(chunks)


def unpack_codes_by_component(packed: torch.Tensor, tokens: int, bits: torch.Tensor) -> torch.Tensor:
    """Invert :func:`pack_codes` into component-major codes ``[n, tokens]`` (uint8; zero rows for
    0-bit columns): each field lands as whole contiguous rows."""
    if packed.numel() != packed_size(tokens, bits):
        raise ValueError(f"packed codes hold {packed.numel()} bytes, expected {packed_size(tokens, bits)}")
    codes = torch.zeros(bits.numel(), tokens, dtype=torch.uint8, device=packed.device)
    offset = 0
    current: tuple[int, torch.Tensor] | None = None
    value = None
    for cols, width, part in _field_layout(bits.cpu()):
        count = tokens * cols.numel()
        nbytes = -(-count // (8 // part))
        field = _unpack_field(packed[offset:offset + nbytes], part, count).view(-1, tokens)
        offset += nbytes
        shifted = field << _part_shift(width, part) if _part_shift(width, part) else field
        if current is None or current[0] != width:
            if current is not None:
                codes.index_copy_(0, current[1].to(packed.device), value)
            current, value = (width, cols), shifted
        else:
            value = value | shifted
    if current is not None:
        codes.index_copy_(0, current[1].to(packed.device), value)
    return codes


def unpack_codes(packed: torch.Tensor, tokens: int, bits: torch.Tensor) -> torch.Tensor:
    """Invert :func:`pack_codes`: codes ``[tokens, n]`` (a transposed view of the component-major codes)."""
    return unpack_codes_by_component(packed, tokens, bits).t()


def _pack_field(values: torch.Tensor, part: int) -> torch.Tensor:
    if part == 8:
        return values.to(torch.uint8)
    per_byte = 8 // part
    values = torch.cat([values, values.new_zeros((-values.numel()) % per_byte)]).view(-1, per_byte)
    shifts = torch.arange(0, 8, part, dtype=torch.uint8, device=values.device)
    return (values << shifts).sum(dim=1, dtype=torch.uint8)


def _unpack_field(packed: torch.Tensor, part: int, count: int) -> torch.Tensor:
    if part == 8:
        return packed[:count]
    shifts = torch.arange(0, 8, part, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & ((1 << part) - 1)).flatten()[:count]
