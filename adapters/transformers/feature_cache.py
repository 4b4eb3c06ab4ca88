"""A transformers cache built from (differentiable) SCD features: what calibration trains through."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from scd_store.codecs.scd.layout import KVLayout
from scd_store.codecs.scd.rope import apply_rope, rope_cos_sin


def cache_from_features(model, features: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor,
                        layout: KVLayout, start: int) -> DynamicCache:
    """A batched cache from features ``[B, T, G, C]`` (pre-RoPE keys; gradients flow) at positions
    ``start..`` behind raw sink KV ``[B, L, H, sinks, D]``."""
    b, t = features.shape[:2]
    f = features.view(b, t, layout.num_layers, 2, layout.kv_heads, layout.head_dim)
    cos, sin = rope_cos_sin(torch.arange(start, start + t), layout.head_dim, layout.rope_theta)
    cache = DynamicCache(config=model.config)
    for layer in range(layout.num_layers):
        k = apply_rope(f[:, :, layer, 0].permute(0, 2, 1, 3), cos, sin)
        v = f[:, :, layer, 1].permute(0, 2, 1, 3)
        cache.update(torch.cat([sink_k[:, layer], k], 2), torch.cat([sink_v[:, layer], v], 2), layer)
    return cache
