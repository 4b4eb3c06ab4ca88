"""Bits over a calibrated basis: per-component uniform quantisers, greedy bit allocation, bit packing.

Each code component ``j`` (a coordinate in a layer's PCA basis) gets ``b_j`` bits (0..8) and a
uniform mid-rise quantiser with step ``STEP[b_j] * sigma_j``, where ``sigma_j`` is the component's
calibration standard deviation and ``STEP`` the step that minimises MSE for a unit Gaussian.
Zero bits means the component is not sent (decoded as its mean). Allocation is reverse
water-filling done greedily: each extra bit goes where it removes the most weighted distortion.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

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


# Packing (payload layout "planes-2"). Components are stored grouped by bit width (8 down to 1,
# ascending column within a width), component-major: all tokens of one component together. A w-bit
# width is split into power-of-two parts (7 = 4 + 2 + 1 bits, high bits first); the part values
# ``P`` (``n`` of them, ``p`` bits each, ``k = 8 / p`` per byte) are stored as ``k`` planes of
# ``seg = ceil(n / k)`` bytes (rounded up to 8): byte ``j`` holds ``P[i * seg + j]`` at bit ``i * p``.
# Unpacking plane ``i`` is then one shift and one mask over 64-bit words, written to a contiguous
# slice, so decoding never touches single values from Python or loops over bits.
PACKING = "planes-2"
_PARTS = {w: tuple(p for p in (8, 4, 2, 1) if w & p) for w in range(1, MAX_BITS + 1)}
_LOW_BYTES = 0x0101010101010101


@dataclass(frozen=True, slots=True)
class _Width:
    width: int
    columns: torch.Tensor  # int64, ascending
    parts: tuple[tuple[int, int], ...]  # (part bits, shift inside the code), high to low


@dataclass(frozen=True, slots=True)
class PackingPlan:
    """Where each component's codes live in a packed payload, for one bit allocation."""

    widths: tuple[_Width, ...]
    sorted_row: torch.Tensor  # [n] int64: a component's row in :func:`unpack_sorted`'s output (0-bit: the zero row)
    carried: int  # components with bits (rows before the zero row)

    @classmethod
    def of(cls, bits: torch.Tensor) -> PackingPlan:
        flat = bits.detach().flatten().cpu().to(torch.int64)
        key = flat.numpy().tobytes()
        plan = _PLANS.get(key)
        if plan is None:
            widths, order = [], []
            for width in range(MAX_BITS, 0, -1):
                cols = (flat == width).nonzero().flatten()
                if cols.numel():
                    parts = _PARTS[width]
                    shifts = tuple(sum(parts[i + 1:]) for i in range(len(parts)))
                    widths.append(_Width(width, cols, tuple(zip(parts, shifts, strict=True))))
                    order.append(cols)
            carried = sum(int(w.columns.numel()) for w in widths)
            sorted_row = torch.full((flat.numel(),), carried, dtype=torch.int64)
            if order:
                sorted_row[torch.cat(order)] = torch.arange(carried)
            plan = cls(tuple(widths), sorted_row, carried)
            if len(_PLANS) >= 64:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = plan
        return plan


_PLANS: dict[bytes, PackingPlan] = {}


def _segment(count: int, part: int) -> int:
    """Bytes of one plane holding ``count`` values of ``part`` bits (a multiple of 8)."""
    per_byte = 8 // part
    plane = -(-count // per_byte)
    return -(-plane // 8) * 8


def packed_size(tokens: int, bits: torch.Tensor) -> int:
    """Bytes :func:`pack_codes` produces for ``tokens`` rows."""
    return sum(_segment(tokens * int(w.columns.numel()), part)
               for w in PackingPlan.of(bits).widths for part, _ in w.parts)


def pack_codes(codes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Pack ``codes`` ``[T, n]`` (uint8) using ``bits[j]`` bits for column ``j``; a flat uint8 tensor."""
    chunks = []
    tokens = codes.shape[0]
    for w in PackingPlan.of(bits).widths:
        values = codes[:, w.columns.to(codes.device)].t().flatten()
        for part, shift in w.parts:
            field = (values >> shift) & ((1 << part) - 1) if part < 8 else values
            seg, per_byte = _segment(tokens * w.columns.numel(), part), 8 // part
            planes = torch.zeros(per_byte * seg, dtype=torch.uint8, device=codes.device)
            planes[:field.numel()] = field
            planes = planes.view(per_byte, seg)
            packed = planes[0].clone()
            for i in range(1, per_byte):
                packed |= planes[i] << (i * part)
            chunks.append(packed)
    if not chunks:
        return torch.empty(0, dtype=torch.uint8, device=codes.device)
    return torch.cat(chunks)


def unpack_sorted(packed: torch.Tensor, tokens: int, bits: torch.Tensor) -> torch.Tensor:
    """Invert :func:`pack_codes` into ``[carried + 1, tokens]`` uint8 rows in storage order (bit widths
    high to low) plus a final zero row: ``PackingPlan.of(bits).sorted_row[j]`` is component ``j``'s row."""
    plan = PackingPlan.of(bits)
    expected = packed_size(tokens, bits)
    if packed.numel() != expected:
        raise ValueError(f"packed codes hold {packed.numel()} bytes, expected {expected}")
    if packed.storage_offset() % 8:
        packed = packed.clone()
    regions, offset = [], 0
    for w in plan.widths:
        count = tokens * int(w.columns.numel())
        region_len = max((8 // part) * _segment(count, part) for part, _ in w.parts)
        region = torch.empty(region_len // 8, dtype=torch.int64, device=packed.device)
        scratch = None
        for n_part, (part, shift) in enumerate(w.parts):
            seg = _segment(count, part)
            words = packed[offset:offset + seg].view(torch.int64)
            offset += seg
            mask = ((1 << part) - 1) * _LOW_BYTES if part < 8 else -1
            for i in range(8 // part):
                out = region[i * seg // 8:(i + 1) * seg // 8]
                if n_part == 0:
                    torch.bitwise_right_shift(words, i * part, out=out)
                    if part < 8:
                        out &= mask
                    if shift:
                        out <<= shift
                else:
                    if scratch is None or scratch.numel() < seg // 8:
                        scratch = torch.empty(seg // 8, dtype=torch.int64, device=packed.device)
                    tmp = scratch[:seg // 8]
                    torch.bitwise_right_shift(words, i * part, out=tmp)
                    tmp &= mask
                    if shift:
                        tmp <<= shift
                    out |= tmp
        regions.append(region.view(torch.uint8)[:count].view(-1, tokens))
    regions.append(torch.zeros(1, tokens, dtype=torch.uint8, device=packed.device))
    return torch.cat(regions)


def by_component(sorted_codes: torch.Tensor, sorted_row: torch.Tensor) -> torch.Tensor:
    """Component-major codes ``[n, tokens]`` from :func:`unpack_sorted`'s rows and the plan's ``sorted_row``."""
    return sorted_codes.index_select(0, sorted_row.to(sorted_codes.device))


def unpack_codes_by_component(packed: torch.Tensor, tokens: int, bits: torch.Tensor) -> torch.Tensor:
    """Invert :func:`pack_codes` into component-major codes ``[n, tokens]`` (uint8; zero rows for
    0-bit columns)."""
    return by_component(unpack_sorted(packed, tokens, bits), PackingPlan.of(bits).sorted_row)


def unpack_codes(packed: torch.Tensor, tokens: int, bits: torch.Tensor) -> torch.Tensor:
    """Invert :func:`pack_codes`: codes ``[tokens, n]`` (a transposed view of the component-major codes)."""
    return unpack_codes_by_component(packed, tokens, bits).t()
