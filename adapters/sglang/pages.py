"""SGLang host-pool pages to and from scd-store :class:`KVState`, through the pool's own page accessors.

``get_data_page(index, flat=False)`` shapes per host-pool layout (MHA):

- ``layer_first``: ``[2, layers, page, heads, dim]``
- ``page_first``: ``[2, page, layers, heads, dim]``
- ``page_first_direct``: ``[2, 1, layers, page, heads, dim]``
- ``page_head``: ``[2, 1, heads, page, layers, dim]``
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

from scd_store.codecs.kv_state import KVState

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def page_hash_bytes(key: str) -> bytes:
    """A 16-byte store hash for SGLang's page key (a SHA-256 chain over the prefix, as hex)."""
    return xxhash.xxh3_128(b"sglang/page/" + key.encode()).digest()


def _to_lhtd(page: torch.Tensor, layout: str) -> torch.Tensor:
    """One of K / V of a page -> ``[layers, heads, tokens, dim]``."""
    if layout == "layer_first":
        return page.permute(0, 2, 1, 3)
    if layout == "page_first":
        return page.permute(1, 2, 0, 3)
    if layout == "page_first_direct":
        return page[0].permute(0, 2, 1, 3)
    return page[0].permute(3, 0, 1, 2)  # page_head: [heads, page, layers, dim]


def _from_lhtd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "layer_first":
        return x.permute(0, 2, 1, 3)
    if layout == "page_first":
        return x.permute(2, 0, 1, 3)
    if layout == "page_first_direct":
        return x.permute(0, 2, 1, 3).unsqueeze(0)
    return x.permute(1, 2, 0, 3).unsqueeze(0)


def read_page(pool: Any, host_index: int, start: int) -> KVState:
    """The page at ``host_index`` of ``pool`` as a float32 state at absolute position ``start``."""
    page = pool.get_data_page(host_index, flat=False)
    return KVState(_to_lhtd(page[0], pool.layout).float().contiguous(),
                   _to_lhtd(page[1], pool.layout).float().contiguous(), start=start)


def flat_page(state: KVState, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """``state`` as the flat page tensor of a pool with ``layout`` (what ``get_data_page(flat=True)`` returns)."""
    return torch.stack([_from_lhtd(state.keys, layout), _from_lhtd(state.values, layout)]).to(dtype).flatten()


def state_from_flat(flat: torch.Tensor, layout: str, layers: int, heads: int, dim: int, start: int) -> KVState:
    """Inverse of :func:`flat_page`."""
    tokens = flat.numel() // (2 * layers * heads * dim)
    shape = {"layer_first": (2, layers, tokens, heads, dim), "page_first": (2, tokens, layers, heads, dim),
             "page_first_direct": (2, 1, layers, tokens, heads, dim),
             "page_head": (2, 1, heads, tokens, layers, dim)}[layout]
    page = flat.reshape(shape)
    return KVState(_to_lhtd(page[0], layout).float().contiguous(), _to_lhtd(page[1], layout).float().contiguous(),
                   start=start)


def write_page(pool: Any, host_index: int, state: KVState) -> None:
    """Write ``state`` (one page) into ``pool`` at ``host_index``."""
    pool.set_from_flat_data_page(host_index, flat_page(state, pool.layout, pool.dtype))
