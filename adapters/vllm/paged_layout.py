"""Reading and writing tokens of vLLM's paged KV cache in the engine's own layout: :func:`read_tokens`,
:func:`write_tokens` and the per-layer gather maps (:func:`layer_maps`) they read through.

vLLM-CPU's per-layer cache is ``[num_blocks, kv_heads, block_size, 2 * head_dim]``; its attention
backend packs keys for the kernel of the CPU's ISA (vec, vec16, amx, neon, ...), so a naive view
reads values right and keys wrong. Writes therefore always go through the backend's own
``do_kv_cache_update`` (the op the engine itself writes with). Reads use a gather map derived once
per layer from that same op: digit-coded tokens are written into a one-block scratch cache and
read back, which gives, for every (head, token, dim) of a block, where the op put it. The map is
then checked on random KV (written by the op, read by the map, bit for bit) before it is used;
a layout it cannot explain is refused (:class:`LayoutError`), never guessed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from scd_store.errors import ScdStoreError

DIGIT = 64  # every dtype the CPU backend caches in holds 1..64 exactly


class LayoutError(ScdStoreError, RuntimeError):
    """vLLM's KV cache layout is not one scd-store can read and write exactly."""


@dataclass(slots=True)
class BlockMap:
    """Where the backend's op puts key / value element ``(head, token, dim)`` of a block: flat offsets
    into the block's elements, ``[kv_heads, block_size, head_dim]`` each."""

    keys: torch.Tensor
    values: torch.Tensor


def _write(layer: Any, cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """The backend's own cache write: ``keys`` / ``values`` ``[tokens, kv_heads, head_dim]`` into ``slots``."""
    layer.impl.do_kv_cache_update(layer, keys.contiguous(), values.contiguous(), cache, slots)


def _locate(layer: Any, like: torch.Tensor, which: int) -> torch.Tensor:
    """Offsets in one block of every element the op writes for key (``which`` 0) or value (1)."""
    _, heads, block, width = like.shape
    dim = width // 2
    count = heads * block * dim
    index = torch.arange(count, dtype=torch.int64).view(heads, block, dim).transpose(0, 1)  # [tokens, heads, dim]
    found = torch.zeros(like[0].numel(), dtype=torch.int64)
    slots = torch.arange(block, dtype=torch.int64)
    for place in range(max(1, math.ceil(math.log(count, DIGIT)))):
        digits = (index // DIGIT ** place) % DIGIT + 1
        scratch = torch.zeros((1, heads, block, width), dtype=like.dtype, device=like.device)
        coded, blank = digits.to(like.dtype).to(like.device), torch.zeros(digits.shape, dtype=like.dtype,
                                                                         device=like.device)
        _write(layer, scratch, *((coded, blank) if which == 0 else (blank, coded)), slots)
        read = scratch.view(-1).to(torch.int64).cpu()
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


def probe(layer: Any, cache: torch.Tensor) -> BlockMap:
    """The gather map of ``layer``'s cache, derived from its backend's op and checked on random KV."""
    if cache.dim() != 4 or cache.shape[-1] % 2:
        raise LayoutError(f"expected vLLM-CPU's [blocks, kv_heads, block_size, 2*head_dim] cache, got "
                          f"{tuple(cache.shape)}")
    if not cache.is_floating_point() or cache.element_size() < 2:
        raise LayoutError(f"a {cache.dtype} KV cache (quantised) cannot carry decoded codes; use --kv-cache-dtype auto")
    block_map = BlockMap(_locate(layer, cache, 0), _locate(layer, cache, 1))
    _, heads, block, width = cache.shape
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn((2 * block, heads, width // 2), generator=generator).to(cache.dtype)
                    for _ in range(2))
    scratch = torch.zeros((3, heads, block, width), dtype=cache.dtype, device=cache.device)
    slots = torch.arange(block // 2, block // 2 + 2 * block, dtype=torch.int64)
    _write(layer, scratch, keys.to(cache.device), values.to(cache.device), slots)
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
        kind = (type(layer.impl), getattr(layer, "isa", None), getattr(layer.impl, "kv_cache_dtype", None),
                tuple(cache.shape[1:]), cache.dtype, cache.device)
        if kind not in probed:
            probed[kind] = probe(layer, cache)
        maps.append(probed[kind])
    return maps


def read_tokens(block_map: BlockMap, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[tokens, kv_heads, head_dim]`` (copies) of the tokens at ``slots``."""
    block = cache.shape[2]
    slots = slots.to(cache.device)
    blocks, offsets = slots // block, slots % block
    flat = cache.view(cache.shape[0], -1)
    rows = blocks[:, None, None]
    keys = flat[rows, block_map.keys.to(cache.device)[:, offsets, :].permute(1, 0, 2)]
    values = flat[rows, block_map.values.to(cache.device)[:, offsets, :].permute(1, 0, 2)]
    return keys, values


def write_tokens(layer: Any, cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Write ``keys`` / ``values`` ``[tokens, kv_heads, head_dim]`` at ``slots`` with the backend's own op."""
    _write(layer, cache, keys.to(cache.dtype), values.to(cache.dtype), slots.to(cache.device))
