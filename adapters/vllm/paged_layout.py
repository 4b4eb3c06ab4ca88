"""Reading and writing tokens of vLLM's paged KV cache in the engine's own layout: :func:`read_tokens`,
:func:`write_tokens` and the per-layer gather maps (:func:`layer_maps`) they read through.

vLLM 0.32 hands every attention layer (CPU, FlashAttention, FlashInfer, Triton) a logical
``[blocks, kv_heads, block_size, 2 * head_dim]`` view; its strides follow the engine's
``KVCacheLayout`` (LBNHC, LBHNC, BLNHC, ...: a per-layer view may skip the other layers' pages), and
``block_size`` is the kernel's block (a manager block may be split into several). How a backend
places one token's key and value inside that view is its own business: vLLM-CPU packs keys for the
kernel of the CPU's ISA (vec, vec16, amx, neon, ...), the CUDA backends put ``[K | V]`` on the last
axis. Writes therefore always go through the backend's own ``do_kv_cache_update`` (the op the
engine itself writes with). Reads use a gather map derived once per kind of layer from that same
op: digit-coded tokens are written into a one-block scratch cache (laid out in memory like the
engine's) and read back, which gives, for every (head, token, dim) of a block, the logical index
the op put it at. The map is then checked on random KV (written by the op, read by the map, bit
for bit) before it is used; a layout it cannot explain is refused (:class:`LayoutError`), never
guessed. Everything runs on the cache's device, and reads index the engine's view through its own
strides (never a flat ``view`` of it).

Where the backend's op is checked to write ``[K | V]`` on the view's last axis, as vLLM's CUDA backends do
(:func:`writes_kv_view`), a consumer's codes are decoded straight into the cache through a slot table
(:func:`paged_target`, :meth:`Codec.decode_paged <scd_store.codecs.base.Codec.decode_paged>`), with no
buffers and no op call; vLLM-CPU's packed keys fail that check and are written through the op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from scd_store.codecs.paged import PagedCaches, kv_view, paged_caches
from scd_store.errors import ScdStoreError

DIGIT = 64  # every float dtype a KV cache is kept in (bf16 included) holds 1..64 exactly


class LayoutError(ScdStoreError, RuntimeError):
    """vLLM's KV cache layout is not one scd-store can read and write exactly."""


@dataclass(slots=True)
class BlockMap:
    """Where the backend's op puts key / value element ``(head, token, dim)`` of a block: offsets into the
    block's logical ``[kv_heads, block_size, 2 * head_dim]`` elements (row-major), ``[kv_heads, block_size,
    head_dim]`` each, on the cache's device."""

    keys: torch.Tensor
    values: torch.Tensor

    def to(self, device: torch.device) -> BlockMap:
        return BlockMap(self.keys.to(device), self.values.to(device))


def scratch_like(cache: torch.Tensor, blocks: int) -> torch.Tensor:
    """A zeroed cache of ``blocks`` blocks shaped like ``cache`` and with its axes in the same memory order
    (the engine's ``KVCacheLayout``), on its device and in its dtype."""
    order = memory_order(cache)
    shape = [blocks if d == 0 else cache.shape[d] for d in order]
    inverse = [order.index(d) for d in range(cache.dim())]
    return torch.zeros(shape, dtype=cache.dtype, device=cache.device).permute(inverse)


def _write(layer: Any, cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """The backend's own cache write: ``keys`` / ``values`` ``[tokens, kv_heads, head_dim]`` into ``slots``."""
    layer.impl.do_kv_cache_update(layer, keys.contiguous(), values.contiguous(), cache, slots)


def _locate(layer: Any, like: torch.Tensor, which: int) -> torch.Tensor:
    """Logical offsets in one block of every element the op writes for key (``which`` 0) or value (1)."""
    _, heads, block, width = like.shape
    dim = width // 2
    count = heads * block * dim
    index = torch.arange(count, dtype=torch.int64).view(heads, block, dim).transpose(0, 1)  # [tokens, heads, dim]
    found = torch.zeros(like[0].numel(), dtype=torch.int64)
    slots = torch.arange(block, dtype=torch.int64, device=like.device)
    for place in range(max(1, math.ceil(math.log(count, DIGIT)))):
        digits = (index // DIGIT ** place) % DIGIT + 1
        scratch = scratch_like(like, 1)
        coded, blank = digits.to(like.dtype).to(like.device), torch.zeros(digits.shape, dtype=like.dtype,
                                                                         device=like.device)
        _write(layer, scratch, *((coded, blank) if which == 0 else (blank, coded)), slots)
        read = scratch.reshape(-1).to(torch.int64).cpu()  # logical order, whatever the strides
        found += torch.where(read > 0, (read - 1) * DIGIT ** place, torch.zeros_like(read))
        if place == 0:
            written = read > 0
    where = torch.nonzero(written).flatten()
    if where.numel() != count:
        raise LayoutError(f"the cache op wrote {where.numel()} elements for {count} (layout {tuple(like.shape)})")
    offsets = torch.full((count,), -1, dtype=torch.int64)
    offsets[found[where]] = where
    if bool((offsets < 0).any()):
        raise LayoutError("the cache op's layout is not a permutation of a block's elements")
    return offsets.view(heads, block, dim)


def cache_problem(cache: torch.Tensor) -> str | None:
    """Why ``cache`` is not a cache scd-store can read and write (None: it is one)."""
    if cache.dim() != 4 or cache.shape[-1] % 2:
        return f"expected vLLM's [blocks, kv_heads, block_size, 2*head_dim] cache view, got {tuple(cache.shape)}"
    if not cache.is_floating_point() or cache.element_size() < 2:
        return f"a {cache.dtype} KV cache (quantised) cannot carry decoded codes; use --kv-cache-dtype auto"
    return None


def _written_scratch(layer: Any, cache: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    """A three-block scratch cache laid out like ``cache``, random keys and values ``[2 * block_size, heads,
    head_dim]`` (on the CPU) the backend's op wrote into it, and their slots (from the middle of block 0)."""
    _, heads, block, width = cache.shape
    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn((2 * block, heads, width // 2), generator=generator).to(cache.dtype)
                    for _ in range(2))
    scratch = scratch_like(cache, 3)
    slots = torch.arange(block // 2, block // 2 + 2 * block, dtype=torch.int64, device=cache.device)
    _write(layer, scratch, keys.to(cache.device), values.to(cache.device), slots)
    return scratch, keys, values, slots


def probe(layer: Any, cache: torch.Tensor) -> BlockMap:
    """The gather map of ``layer``'s cache, derived from its backend's op and checked on random KV, on the
    cache's device."""
    problem = cache_problem(cache)
    if problem is not None:
        raise LayoutError(problem)
    block_map = BlockMap(_locate(layer, cache, 0), _locate(layer, cache, 1)).to(cache.device)
    scratch, keys, values, slots = _written_scratch(layer, cache, seed=0)
    got_k, got_v = read_tokens(block_map, scratch, slots)
    if not (torch.equal(got_k.cpu(), keys) and torch.equal(got_v.cpu(), values)):
        raise LayoutError("keys or values read back through the derived map differ from what the cache op wrote")
    return block_map


def layer_maps(layers: list[Any], caches: list[torch.Tensor]) -> list[BlockMap]:
    """Each layer's map, probed once per kind of layer: the op's backend, ISA and KV dtype, and the cache's
    geometry and dtype decide where it puts an element, so layers alike in all of these share one map."""
    probed: dict[tuple, BlockMap] = {}
    maps = []
    for layer, cache in zip(layers, caches, strict=True):
        kind = layer_kind(layer, cache)
        if kind not in probed:
            probed[kind] = probe(layer, cache)
        maps.append(probed[kind])
    return maps


def layer_kind(layer: Any, cache: torch.Tensor) -> tuple:
    """What decides where a layer's op puts an element: its backend, ISA and KV dtype, and its cache's geometry,
    memory order, dtype and device (layers alike in all of these write alike)."""
    return (type(layer.impl), getattr(layer, "isa", None), getattr(layer.impl, "kv_cache_dtype", None),
            tuple(cache.shape[1:]), memory_order(cache), cache.dtype, cache.device)


def memory_order(cache: torch.Tensor) -> tuple[int, ...]:
    """``cache``'s axes from the outermost in memory to the innermost (by stride)."""
    return tuple(sorted(range(cache.dim()), key=lambda d: (-cache.stride(d), d)))


def read_tokens(block_map: BlockMap, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[tokens, kv_heads, head_dim]`` (copies, on the cache's device) of the tokens at
    ``slots`` (``block * block_size + offset`` in the cache's own, kernel-sized, blocks; vLLM's slot
    mapping is that whether or not a manager block is split)."""
    _, _, block, width = cache.shape
    slots = slots.to(cache.device)
    rows = (slots // block)[:, None, None]
    offsets = slots % block

    def gather(where: torch.Tensor) -> torch.Tensor:
        where = where.to(cache.device)[:, offsets, :].permute(1, 0, 2)  # [tokens, heads, dim]
        return cache[rows, where // (block * width), (where // width) % block, where % width]
    return gather(block_map.keys), gather(block_map.values)


def write_tokens(layer: Any, cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Write ``keys`` / ``values`` ``[tokens, kv_heads, head_dim]`` at ``slots`` with the backend's own op."""
    _write(layer, cache, keys.to(cache.dtype), values.to(cache.dtype), slots.to(cache.device))


def writes_kv_view(layer: Any, cache: torch.Tensor) -> bool:
    """Whether ``layer``'s backend op puts token ``t``'s key and value where :func:`kv_view` reads them
    (``[K | V]`` on the last axis of each head's row, at ``[slot // block_size, :, slot % block_size]``), checked
    on random KV written by the op into a scratch cache laid out like ``cache``, bit for bit."""
    if cache_problem(cache) is not None:
        return False
    try:
        scratch, keys, values, slots = _written_scratch(layer, cache, seed=1)
    except Exception:  # noqa: BLE001 - an op that cannot write a scratch cache is not one to write around
        return False
    view, block = kv_view(scratch), cache.shape[2]
    rows, places = slots // block, slots % block
    got_k, got_v = view[:, 0][rows, places].cpu(), view[:, 1][rows, places].cpu()  # [tokens, heads, dim]
    return torch.equal(got_k, keys) and torch.equal(got_v, values) and int(scratch.count_nonzero()) == \
        int(keys.count_nonzero()) + int(values.count_nonzero())


def paged_target(layers: list[Any], caches: list[torch.Tensor]) -> PagedCaches | None:
    """Every layer's cache as one :class:`PagedCaches` where each kind of layer's op writes what
    :func:`kv_view` reads (:func:`writes_kv_view`) and the caches are alike in shape, strides and dtype;
    None otherwise (write through the op)."""
    checked: dict[tuple, bool] = {}
    for layer, cache in zip(layers, caches, strict=True):
        kind = layer_kind(layer, cache)
        if kind not in checked:
            checked[kind] = writes_kv_view(layer, cache)
        if not checked[kind]:
            return None
    try:
        return paged_caches(caches)
    except ValueError:
        return None
