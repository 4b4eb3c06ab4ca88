"""LMCache's chunk layout and keys, to and from scd-store's :class:`KVState` and 16-byte chunk hashes:
:func:`chunk_hash_bytes`, :func:`state_from_kv_2ltd`, :func:`kv_2ltd_views`."""

from __future__ import annotations

import hashlib
import json

import torch

from scd_store.codecs.kv_state import KVState


def chunk_hash_bytes(chunk_hash: int, namespace: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A 16-byte store hash for LMCache's integer chunk hash (which already chains over the prefix), in
    a tenant ``namespace`` (LMCache's request tags): other tags, other hashes."""
    data = b"lmcache/chunk/%d" % int(chunk_hash)
    if namespace:
        data += b"|tags|" + json.dumps(sorted(namespace), separators=(",", ":")).encode()
    return hashlib.sha256(data).digest()[:16]  # tags are a tenant's: a cryptographic hash, never a fast one


def state_from_kv_2ltd(tensor: torch.Tensor, num_kv_heads: int, start: int) -> KVState:
    """``[2, layers, tokens, heads * head_dim]`` (LMCache ``KV_2LTD``) -> a float32 :class:`KVState`."""
    if tensor.dim() != 4 or tensor.shape[0] != 2 or tensor.shape[3] % num_kv_heads:
        raise ValueError(f"not a KV_2LTD chunk with {num_kv_heads} kv heads: shape {tuple(tensor.shape)}")
    layers, tokens, width = tensor.shape[1:]
    kv = tensor.float().view(2, layers, tokens, num_kv_heads, width // num_kv_heads).permute(0, 1, 3, 2, 4)
    return KVState(kv[0].contiguous(), kv[1].contiguous(), start=start)


def kv_2ltd_views(tensor: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` views ``[layers, heads, tokens, head_dim]`` of a ``[2, layers, tokens, heads *
    head_dim]`` (LMCache ``KV_2LTD``) tensor: what a codec decodes into in place."""
    if tensor.dim() != 4 or tensor.shape[0] != 2 or tensor.shape[3] % num_kv_heads:
        raise ValueError(f"not a KV_2LTD chunk with {num_kv_heads} kv heads: shape {tuple(tensor.shape)}")
    layers, tokens, width = tensor.shape[1:]
    view = tensor.view(2, layers, tokens, num_kv_heads, width // num_kv_heads).permute(0, 1, 3, 2, 4)
    return view[0], view[1]
