"""SGLang host-pool pages to and from scd-store :class:`KVState`, through the pool's own page accessors:
:func:`read_page`, :func:`flat_page`, :func:`state_from_flat`, and :func:`page_hash_bytes`
for page keys.

``get_data_page(index, flat=False)`` shapes per host-pool layout (MHA), after the leading K / V axis
of 2, are given by :data:`AXES`: ``layer_first`` ``[layers, page, heads, dim]``, ``page_first``
``[page, layers, heads, dim]``, ``page_first_direct`` ``[1, layers, page, heads, dim]``, ``page_head``
``[1, heads, page, layers, dim]``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from scd_store.codecs.kv_state import KVState

# axis order of one of K / V of a page per layout (L layers, H heads, T page tokens, D dim; "1" a unit page axis)
AXES = {"layer_first": "LTHD", "page_first": "TLHD", "page_first_direct": "1LTHD", "page_head": "1HTLD"}
LAYOUTS = tuple(AXES)
STATE_AXES = "LHTD"  # KVState's order


def page_hash_bytes(key: str) -> bytes:
    """A 16-byte store hash for SGLang's page key (a SHA-256 chain over the prefix, as hex)."""
    return hashlib.sha256(b"sglang/page/" + key.encode()).digest()[:16]


def _to_lhtd(page: torch.Tensor, layout: str) -> torch.Tensor:
    """One of K / V of a page -> ``[layers, heads, tokens, dim]``."""
    axes = AXES[layout].lstrip("1")
    page = page.reshape(page.shape[len(AXES[layout]) - len(axes):])
    return page.permute(*(axes.index(a) for a in STATE_AXES))


def _from_lhtd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of :func:`_to_lhtd`."""
    axes = AXES[layout]
    x = x.permute(*(STATE_AXES.index(a) for a in axes.lstrip("1")))
    return x.reshape((1,) * (len(axes) - x.dim()) + tuple(x.shape))


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
    sizes = {"1": 1, "L": layers, "H": heads, "T": flat.numel() // (2 * layers * heads * dim), "D": dim}
    page = flat.reshape(2, *(sizes[a] for a in AXES[layout]))
    return KVState(_to_lhtd(page[0], layout).float().contiguous(), _to_lhtd(page[1], layout).float().contiguous(),
                   start=start)

