"""The fused REUSE decode written straight into vLLM's paged KV cache, through a slot table.

:func:`decode_paged` is the one entry point: one Triton launch decodes every layer's keys and values
(codes -> folded decoder matmul -> RoPE on keys, as :mod:`~scd_store.codecs.scd.fused`) and stores
token ``t`` at cache slot ``slots[t]`` (``block = slot // block_size``, ``offset = slot % block_size``)
of every layer, cast to the cache's dtype; a second, small launch copies the payload's raw sink tokens.
A slot below 0 (or past the cache) skips its token. :func:`decode_paged_eager` does the same with the
codec's own decode and a PyTorch scatter: the reference, and the fallback on a CPU or without Triton.

Caches are :class:`~scd_store.codecs.paged.PagedCaches` (any element strides, one table of each layer's
first element: one launch writes all layers whether they are views of one allocation, vLLM's
``KVCacheTensor``, or separate tensors). The codec is duck-typed (:class:`FusedCodec`): this module
imports nothing of :mod:`~scd_store.codecs.scd.codec`, which calls it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from scd_store.codecs.paged import (
    CACHE_DTYPES,
    PagedCaches,
    check_fit,
    check_slots,
    kv_view,
    paged_caches,
    scatter_eager,
    slot_table,
)
from scd_store.codecs.scd import fused
from scd_store.codecs.tensor_pack import PayloadError

if TYPE_CHECKING:
    from scd_store.codecs.scd.decoder import PairDecoder
    from scd_store.codecs.scd.space import CodeSpace, SpaceCodes

__all__ = ["CACHE_DTYPES", "FusedCodec", "PagedCaches", "available", "check_paged", "decode_paged",
           "decode_paged_eager", "kv_view", "paged_caches", "paged_decode", "paged_scatter", "scatter_eager",
           "slot_table"]

log = logging.getLogger(__name__)

_FAILED: set[str] = set()  # devices where a paged kernel did not build: they decode eagerly from then on


@functools.cache
def _kernels():  # noqa: ANN202 - two triton.JITFunctions
    import triton
    import triton.language as tl

    @triton.jit
    def decode_kernel(codes, rows, matrix, offset, cos, sin, cache, layer_offsets, slots, tokens, active, width,
                      num_slots, s_codes, s_block, s_kv, s_pos, s_head, s_dim, BLOCK_SIZE: tl.constexpr,
                      HALF: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, FP16: tl.constexpr):
        # 64-bit offsets (as fused.decode_kernel): head * s_head of a heads-outermost cache passes 2**31
        group, block = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        head = tl.program_id(2).to(tl.int64)
        t = block * BT + tl.arange(0, BT).to(tl.int64)
        t_ok = t < tokens
        d = tl.arange(0, HALF).to(tl.int64)
        lo_cols = head * 2 * HALF + d
        acc_lo = tl.zeros((BT, HALF), dtype=tl.float32)
        acc_hi = tl.zeros((BT, HALF), dtype=tl.float32)
        for c0 in range(0, active, BC):  # the products exactly as fused.decode_kernel: the same bits
            c = c0 + tl.arange(0, BC).to(tl.int64)
            c_ok = c < active
            row = tl.load(rows + group * active + c, mask=c_ok, other=0).to(tl.int64)
            q = tl.load(codes + row[None, :] * s_codes + t[:, None], mask=t_ok[:, None] & c_ok[None, :], other=0)
            m_ptr = matrix + (group * active + c[:, None]) * width + lo_cols[None, :]
            m_lo = tl.load(m_ptr, mask=c_ok[:, None], other=0.0)
            m_hi = tl.load(m_ptr + HALF, mask=c_ok[:, None], other=0.0)
            if FP16:
                qf = q.to(tl.float16)
                acc_lo += tl.dot(qf, m_lo)
                acc_hi += tl.dot(qf, m_hi)
            else:
                qf = q.to(tl.float32)
                acc_lo += tl.dot(qf, m_lo, input_precision="ieee")
                acc_hi += tl.dot(qf, m_hi, input_precision="ieee")
        acc_lo += tl.load(offset + group * width + lo_cols)[None, :]
        acc_hi += tl.load(offset + group * width + lo_cols + HALF)[None, :]
        # the token's cache slot (< 0 or past the cache: skipped); written out in both kernels, since Triton's
        # interpreter resolves no @jit helper defined in this closure
        slot = tl.load(slots + t, mask=t_ok, other=-1)
        ok = t_ok & (slot >= 0) & (slot < num_slots)
        slot = tl.where(ok, slot, 0).to(tl.int64)
        where = (slot // BLOCK_SIZE) * s_block + (slot % BLOCK_SIZE) * s_pos
        kv = group % 2
        row = cache + tl.load(layer_offsets + group // 2) + kv * s_kv + head * s_head + where[:, None]
        out, out_hi = row + d[None, :] * s_dim, row + (d[None, :] + HALF) * s_dim
        mask = ok[:, None]
        if kv == 0:
            cs = tl.load(cos + t[:, None] * HALF + d[None, :], mask=t_ok[:, None], other=0.0)
            sn = tl.load(sin + t[:, None] * HALF + d[None, :], mask=t_ok[:, None], other=0.0)
            tl.store(out, (acc_lo * cs - acc_hi * sn).to(cache.dtype.element_ty), mask=mask)
            tl.store(out_hi, (acc_hi * cs + acc_lo * sn).to(cache.dtype.element_ty), mask=mask)
        else:
            tl.store(out, acc_lo.to(cache.dtype.element_ty), mask=mask)
            tl.store(out_hi, acc_hi.to(cache.dtype.element_ty), mask=mask)

    @triton.jit
    def scatter_kernel(keys, values, cache, layer_offsets, slots, tokens, num_slots, s_kl, s_kh, s_kt, s_kd,
                       s_vl, s_vh, s_vt, s_vd, s_block, s_kv, s_pos, s_head, s_dim, BLOCK_SIZE: tl.constexpr,
                       DIM: tl.constexpr, BT: tl.constexpr):
        group, block = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        head = tl.program_id(2).to(tl.int64)  # 64-bit offsets
        layer, kv = group // 2, group % 2
        t = block * BT + tl.arange(0, BT).to(tl.int64)
        t_ok = t < tokens
        d = tl.arange(0, DIM).to(tl.int64)
        if kv == 0:
            src = keys + layer * s_kl + head * s_kh + t[:, None] * s_kt + d[None, :] * s_kd
        else:
            src = values + layer * s_vl + head * s_vh + t[:, None] * s_vt + d[None, :] * s_vd
        x = tl.load(src, mask=t_ok[:, None], other=0.0)
        slot = tl.load(slots + t, mask=t_ok, other=-1)  # the token's cache slot; < 0 or past the cache: skipped
        ok = t_ok & (slot >= 0) & (slot < num_slots)
        slot = tl.where(ok, slot, 0).to(tl.int64)
        where = (slot // BLOCK_SIZE) * s_block + (slot % BLOCK_SIZE) * s_pos
        out = cache + tl.load(layer_offsets + layer) + kv * s_kv + head * s_head + where[:, None] + d[None, :] * s_dim
        tl.store(out, x.to(tl.float32).to(cache.dtype.element_ty), mask=ok[:, None])  # via fp32, as torch casts

    return decode_kernel, scatter_kernel


class FusedCodec(Protocol):
    """What the paged decode reads of an SCD codec (:class:`~scd_store.codecs.scd.codec.ScdCodec`)."""

    space: CodeSpace
    decoder: PairDecoder | None
    reuse_only: bool

    def decode_codes(self, codes: SpaceCodes, device, dtype: torch.dtype,
                     angles: tuple[torch.Tensor, torch.Tensor] | None = None): ...  # noqa: ANN201

    def angles(self, start: int, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _folded(self, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...


def available(device: torch.device | str, head_dim: int) -> bool:
    """Whether the paged kernels run for ``device`` and ``head_dim`` (:func:`fused.available`: CUDA with
    Triton, or Triton's interpreter; a power-of-two head_dim from 32)."""
    return fused.available(device, head_dim) and str(torch.device(device)) not in _FAILED


def _check_target(cache: torch.Tensor, layer_offsets: torch.Tensor, strides: Sequence[int], block_size: int) -> None:
    if cache.dtype not in CACHE_DTYPES or len(strides) != 5 or block_size < 1 or layer_offsets.dim() != 1 \
            or layer_offsets.dtype != torch.int64 or layer_offsets.device != cache.device:
        raise ValueError("paged target: cache dtype, five strides, block_size or int64 layer offsets do not match")


def paged_decode(sorted_codes: torch.Tensor, rows: torch.Tensor, matrix: torch.Tensor, offset: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, layer_offsets: torch.Tensor,
                 strides: Sequence[int], block_size: int, num_blocks: int, slots: torch.Tensor) -> None:
    """:func:`fused.fused_decode`'s keys and values of token ``t``, every layer, into cache slot ``slots[t]``.

    ``cache``: the base pointer (its dtype is the cache's); layer ``l``'s ``(block, kv, position, head, dim)``
    element lies at ``cache + layer_offsets[l] + block * strides[0] + ... + dim * strides[4]``. The other
    operands are :func:`fused.fused_decode`'s; ``slots`` ``[T]`` int64, below 0 or past ``num_blocks *
    block_size``: skipped."""
    groups, active = rows.shape
    tokens, half = cos.shape
    width = matrix.shape[2] if matrix.dim() == 3 else -1
    _check_target(cache, layer_offsets, strides, block_size)
    if half < 1 or groups != 2 * layer_offsets.shape[0] or matrix.shape[:2] != (groups, active) or width % (2 * half) \
            or sin.shape != cos.shape or offset.shape != (groups, width) or sorted_codes.stride(1) != 1 \
            or sorted_codes.shape[1] != tokens:
        raise ValueError("paged_decode: shapes or strides do not match")
    check_slots(slots, tokens, cache.device)
    if not tokens:
        return
    grid = (groups, -(-tokens // fused.BLOCK_T), width // (2 * half))
    _kernels()[0][grid](sorted_codes, rows.contiguous(), matrix.contiguous(), offset.contiguous(), cos.contiguous(),
                        sin.contiguous(), cache, layer_offsets, slots, tokens, active, width, num_blocks * block_size,
                        sorted_codes.stride(0), *strides, BLOCK_SIZE=block_size, HALF=half, BT=fused.BLOCK_T,
                        BC=fused.BLOCK_C, FP16=matrix.dtype == torch.float16)


def paged_scatter(keys: torch.Tensor, values: torch.Tensor, cache: torch.Tensor, layer_offsets: torch.Tensor,
                  strides: Sequence[int], block_size: int, num_blocks: int, slots: torch.Tensor) -> None:
    """Keys and values ``[L, H, T, D]`` (any strides) into the paged cache as :func:`paged_decode` writes."""
    _check_target(cache, layer_offsets, strides, block_size)
    if keys.dim() != 4 or keys.shape != values.shape or keys.shape[0] != layer_offsets.shape[0]:
        raise ValueError("paged_scatter: shapes do not match")
    layers, heads, tokens, dim = keys.shape
    check_slots(slots, tokens, cache.device)
    if not tokens:
        return
    grid = (2 * layers, -(-tokens // fused.BLOCK_T), heads)
    _kernels()[1][grid](keys, values, cache, layer_offsets, slots, tokens, num_blocks * block_size, *keys.stride(),
                        *values.stride(), *strides, BLOCK_SIZE=block_size, DIM=dim, BT=fused.BLOCK_T)


def check_paged(codec: FusedCodec, codes: SpaceCodes, caches: PagedCaches, slots: torch.Tensor,
                angles: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Raise ``ValueError`` where the codes, caches, slot table or angles do not fit ``codec`` and each other."""
    if codec.decoder is None:
        raise ValueError("this SCD codec has no consumer decoder: it can encode only")
    layout = codec.space.layout
    check_fit((layout.num_layers, layout.kv_heads, codes.num_tokens, layout.head_dim), caches, slots)
    if codes.sorted_codes.device != caches.device:
        raise ValueError(f"codes on {codes.sorted_codes.device}, caches on {caches.device}")
    coded = codes.num_tokens - (codes.sinks.num_tokens if codes.sinks is not None else 0)
    if angles is not None and any(a.shape[-2:] != (coded, layout.head_dim // 2) or a.device != caches.device
                                  for a in angles):
        raise ValueError(f"angles must be [{coded}, {layout.head_dim // 2}] tables on {caches.device}")


def decode_paged_eager(codec: FusedCodec, codes: SpaceCodes, caches: PagedCaches, slots: torch.Tensor,
                       angles: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The reference: the codec's own decode to ``[L, H, T, D]`` in the caches' dtype, then :func:`scatter_eager`."""
    check_paged(codec, codes, caches, slots, angles)
    state = codec.decode_codes(codes, caches.device, caches.dtype, angles)
    scatter_eager(state.keys, state.values, caches, slots)


def _launch(codec: FusedCodec, codes: SpaceCodes, caches: PagedCaches, slots: torch.Tensor,
            angles: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    layout, device, dtype = codec.space.layout, caches.device, caches.dtype
    sinks = codes.sinks.num_tokens if codes.sinks is not None else 0
    coded = codes.num_tokens - sinks
    if coded:
        try:
            layout.check_positions(codes.start, codes.num_tokens)
        except ValueError as exc:
            raise PayloadError(str(exc)) from None
    target = (caches.base, caches.offsets, caches.strides, caches.block_size, caches.num_blocks)
    if sinks:
        paged_scatter(codes.sinks.keys, codes.sinks.values, *target, slots[:sinks])
    if not coded:
        return
    matrix, offset = codec._folded(device, torch.float32)
    folded = matrix if dtype == torch.float32 else codec._folded(device, fused.matrix_dtype(dtype))[0]
    rows = codes.sorted_row.view(layout.groups, layout.width)[:, :matrix.shape[1]]
    cos, sin = angles if angles is not None else codec.angles(codes.start + sinks, coded, device)
    paged_decode(codes.sorted_codes, rows, folded, offset.view(layout.groups, layout.width), cos, sin, *target,
                 slots[sinks:])


def decode_paged(codec: FusedCodec, codes: SpaceCodes, caches: PagedCaches, slots: torch.Tensor,
                 angles: tuple[torch.Tensor, torch.Tensor] | None = None, *, kernel: bool = True) -> bool:
    """Decode ``codes`` into the paged ``caches`` at ``slots`` (``[T]`` int64, ``< 0``: skip); True where the
    paged kernels ran, False where :func:`decode_paged_eager` did (no Triton, a CPU without the interpreter,
    a codec the kernel does not compute, ``kernel=False``, or a kernel that did not build). Everything is
    checked before anything is launched; the kernel path never waits for the device (CUDA-graph capturable,
    given ``angles``). ``angles``: the coded tokens' RoPE half tables, else read at the codes' positions."""
    check_paged(codec, codes, caches, slots, angles)
    if kernel and codec.reuse_only and available(caches.device, caches.head_dim):
        try:
            _launch(codec, codes, caches, slots, angles)
            return True
        except (ValueError, PayloadError):
            raise
        except Exception as exc:  # noqa: BLE001 - a kernel that does not build costs speed, not the decode
            log.warning("paged SCD decode kernel unavailable (%s); using the PyTorch path", exc)
            _FAILED.add(str(caches.device))
    decode_paged_eager(codec, codes, caches, slots, angles)
    return False
