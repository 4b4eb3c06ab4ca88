"""vLLM-style paged KV caches as codecs write them: :class:`PagedCaches` (every layer's logical ``[blocks, 2 (K /
V), block_size, kv_heads, head_dim]`` view, any element strides, one table of each layer's first element),
vLLM's slot tables (:func:`slot_table`) and the PyTorch scatter of decoded KV into them (:func:`scatter_eager`).

vLLM 0.32's CUDA backends hand ``[blocks, kv_heads, block_size, 2 * head_dim]`` views with ``[K | V]`` on the
last axis; :func:`kv_view` reads them as the logical view (vLLM-CPU packs keys for its own kernels: write those
caches through the backend's op instead). :meth:`Codec.decode_paged <scd_store.codecs.base.Codec.decode_paged>`
writes a payload's KV into such caches; the SCD codec's fused kernel does it in one launch
(:mod:`scd_store.codecs.scd.paged_fused`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, slots=True)
class PagedCaches:
    """Every layer's paged cache as the kernels address it; build once (:func:`paged_caches`), reuse per decode."""

    layers: tuple[torch.Tensor, ...]  # [blocks, 2, block_size, kv_heads, head_dim] views, alike in shape and strides
    base: torch.Tensor  # the lowest-addressed layer's view: the kernels' base pointer
    offsets: torch.Tensor  # [layers] int64 on the caches' device: each layer's first element, in elements from base

    @property
    def strides(self) -> tuple[int, int, int, int, int]:
        """Element strides of (block, K / V, position in block, head, dim)."""
        return tuple(self.base.stride())  # type: ignore[return-value]

    @property
    def num_blocks(self) -> int:
        return self.base.shape[0]

    @property
    def block_size(self) -> int:
        return self.base.shape[2]

    @property
    def heads(self) -> int:
        return self.base.shape[3]

    @property
    def head_dim(self) -> int:
        return self.base.shape[4]

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    @property
    def device(self) -> torch.device:
        return self.base.device


def kv_view(cache: torch.Tensor) -> torch.Tensor:
    """vLLM's CUDA-backend view ``[blocks, kv_heads, block_size, 2 * head_dim]`` (``[K | V]`` last) as the
    logical ``[blocks, 2, block_size, kv_heads, head_dim]`` view of the same memory."""
    if cache.dim() != 4 or cache.shape[-1] % 2:
        raise ValueError(f"expected a [blocks, kv_heads, block_size, 2*head_dim] cache view, got {tuple(cache.shape)}")
    return cache.unflatten(3, (2, cache.shape[-1] // 2)).permute(0, 3, 2, 1, 4)


def paged_caches(caches: Sequence[torch.Tensor]) -> PagedCaches:
    """:class:`PagedCaches` of per-layer caches: vLLM's 4-d views (:func:`kv_view`) or logical 5-d
    ``[blocks, 2, block_size, kv_heads, head_dim]`` views, alike in shape, strides, dtype and device."""
    if not caches:
        raise ValueError("paged_caches: no layer caches")
    views = tuple(kv_view(c) if c.dim() == 4 else c for c in caches)
    first = views[0]
    if first.dim() != 5 or first.shape[1] != 2:
        raise ValueError(f"expected [blocks, 2, block_size, kv_heads, head_dim] cache views, got {tuple(first.shape)}")
    if first.dtype not in CACHE_DTYPES:
        raise ValueError(f"a {first.dtype} KV cache cannot carry decoded codes (one of {CACHE_DTYPES})")
    for v in views:
        if v.shape != first.shape or v.stride() != first.stride() or v.dtype != first.dtype \
                or v.device != first.device:
            raise ValueError("paged_caches: the layers' caches differ in shape, strides, dtype or device")
    pointers = [v.data_ptr() for v in views]
    low = min(range(len(views)), key=pointers.__getitem__)
    size = first.element_size()
    if any((p - pointers[low]) % size for p in pointers):
        raise ValueError("paged_caches: the layers' caches are not element-aligned to one another")
    offsets = torch.tensor([(p - pointers[low]) // size for p in pointers], dtype=torch.int64)
    return PagedCaches(views, views[low], offsets.to(first.device))


def slot_table(block_ids: Sequence[int], first_offset: int, tokens: int, block_size: int,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """``[tokens]`` int64 slots of tokens laid from offset ``first_offset`` of ``block_ids[0]`` on, block after
    block (vLLM's ``slot_mapping``: ``block_id * block_size + offset``)."""
    if not 0 <= first_offset < block_size or first_offset + tokens > len(block_ids) * block_size:
        raise ValueError(f"{tokens} tokens from offset {first_offset} do not fit {len(block_ids)} blocks")
    places = torch.arange(first_offset, first_offset + tokens, dtype=torch.int64)
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    return (ids[places // block_size] * block_size + places % block_size).to(device)


def check_slots(slots: torch.Tensor, tokens: int, device: torch.device) -> None:
    """Raise ``ValueError`` unless ``slots`` is a ``[tokens]`` int64 table on ``device``."""
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.shape != (tokens,) \
            or slots.device != device:
        raise ValueError(f"slots must be a [{tokens}] int64 tensor on {device}")


def check_fit(shape: Sequence[int], caches: PagedCaches, slots: torch.Tensor) -> None:
    """Raise ``ValueError`` unless KV of ``shape`` ``[layers, kv_heads, tokens, head_dim]`` fits ``caches``
    and ``slots``."""
    layers, heads, tokens, dim = shape
    if (layers, heads, dim) != (len(caches.layers), caches.heads, caches.head_dim):
        raise ValueError(f"KV of {layers} layers x {heads} heads x {dim} dims does not fit caches of "
                         f"{len(caches.layers)} x {caches.heads} x {caches.head_dim}")
    check_slots(slots, tokens, caches.device)


def scatter_eager(keys: torch.Tensor, values: torch.Tensor, caches: PagedCaches, slots: torch.Tensor) -> None:
    """Keys and values ``[L, H, T, D]`` into ``caches`` at ``slots`` (below 0 or past the cache: skipped), in
    the caches' dtype: the reference of the paged kernels' scatter."""
    keep = (slots >= 0) & (slots < caches.num_blocks * caches.block_size)
    tokens = keep.nonzero().squeeze(1)
    blocks, positions = slots[tokens] // caches.block_size, slots[tokens] % caches.block_size
    for layer, view in enumerate(caches.layers):
        view[:, 0][blocks, positions] = keys[layer][:, tokens].transpose(0, 1).to(caches.dtype)
        view[:, 1][blocks, positions] = values[layer][:, tokens].transpose(0, 1).to(caches.dtype)
