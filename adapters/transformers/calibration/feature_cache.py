"""A transformers cache built from (differentiable) SCD features: what calibration trains through."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from scd_store.codecs.scd.layout import KVLayout
from scd_store.codecs.scd.rope import apply_rope


def cache_from_features(model, features: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor,
                        layout: KVLayout, start: int) -> DynamicCache:
    """A batched cache from features ``[B, T, G, C]`` (pre-RoPE keys; gradients flow) at positions
    ``start..`` behind raw sink KV ``[B, L, H, sinks, D]``."""
    b, t = features.shape[:2]
    f = features.view(b, t, layout.num_layers, 2, layout.kv_heads, layout.head_dim)
    cos, sin = layout.angles(torch.arange(start, start + t, device=features.device))
    cache = DynamicCache()  # full KV in every layer, sliding-window ones too (their masks still slide)
    # unbind, not per-layer indexing: the backward of one unbind is one stack, while each indexing
    # op's backward would fill a zero tensor the size of all the features (2 x layers of them)
    for layer, kv in enumerate(f.unbind(2)):
        key, value = kv.unbind(2)
        k = apply_rope(key.permute(0, 2, 1, 3), cos[layer] if layout.per_layer_rope else cos,
                       sin[layer] if layout.per_layer_rope else sin)
        v = value.permute(0, 2, 1, 3)
        cache.update(torch.cat([sink_k[:, layer], k], 2), torch.cat([sink_v[:, layer], v], 2), layer)
    return cache
