"""A transformers model's KV geometry as the codecs see it (:class:`KVLayout`)."""

from __future__ import annotations

import torch

from scd_store.codecs.scd.layout import KVLayout


def layout_of(model: torch.nn.Module) -> KVLayout:
    """Layers, KV heads, head dim and RoPE theta of ``model``; only default RoPE is supported."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"only default RoPE is supported, not {rope.get('rope_type')}")
    return KVLayout(config.num_hidden_layers, config.num_key_value_heads, head_dim, float(theta))
