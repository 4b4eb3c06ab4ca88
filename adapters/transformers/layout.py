"""A transformers model's KV geometry and key rotation as the codecs see it (:class:`KVLayout`).

Any decoder-only model with a standard per-layer KV cache: Llama (default, llama3, linear, dynamic,
yarn and longrope RoPE), Qwen2 / 2.5, Qwen3, Mistral, Gemma 2 / 3, Phi-3. The rotation is read from
the model's own rotary embedding module (its frequencies and scaling per layer kind), never
re-derived from the config. Refused with a message: MLA, hybrid (Mamba / linear-attention) layers
and partial rotary embeddings.
"""

from __future__ import annotations

import torch

from scd_store.codecs.scd.layout import KVLayout
from scd_store.codecs.scd.rope import RopeSpec
from scd_store.errors import ScdStoreError

# frequencies that change once a sequence passes the original context (transformers' dynamic update)
_CHANGING = ("dynamic", "longrope")
_HYBRID_LAYERS = ("mamba", "linear_attention", "conv", "mamba2", "recurrent")


class UnsupportedModel(ScdStoreError, ValueError):
    """A model whose KV cache scd-store cannot code (MLA, hybrid layers, partial rotary)."""


def _check_supported(config) -> None:
    name = getattr(config, "model_type", "?")
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        raise UnsupportedModel(f"{name}: multi-head latent attention (MLA) keeps a latent cache, not per-head KV; "
                               "not supported")
    kinds = set(getattr(config, "layer_types", None) or ())
    hybrid = kinds & set(_HYBRID_LAYERS) or getattr(config, "layers_block_type", None) or \
        getattr(config, "attn_layer_indices", None) or "mamba" in name
    if hybrid:
        raise UnsupportedModel(f"{name}: hybrid layers (Mamba / linear attention) keep state that is not KV; "
                               "not supported")
    rope = getattr(config, "rope_parameters", None) or {}
    factors = [getattr(config, "partial_rotary_factor", None)]
    factors += [p.get("partial_rotary_factor") for p in (rope.values() if _per_type(rope) else [rope])]
    if any(f is not None and f < 1.0 for f in factors):
        raise UnsupportedModel(f"{name}: partial rotary embeddings (partial_rotary_factor < 1) are not supported")


def _per_type(rope: dict) -> bool:
    return bool(rope) and all(isinstance(v, dict) for v in rope.values())


def _rotary(model: torch.nn.Module):  # noqa: ANN202 - the model's rotary embedding module
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        raise UnsupportedModel(f"{type(model).__name__} has no model.rotary_emb: only RoPE decoder models are "
                               "supported")
    return rotary


def layout_of(model: torch.nn.Module) -> KVLayout:
    """Layers, KV heads, head dim and the keys' rotation of ``model``."""
    config = model.config
    _check_supported(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    rotary = _rotary(model)
    layer_types = list(getattr(config, "layer_types", None) or [])
    if _per_type(rope):  # Gemma 3: one rotation per layer type, buffers named after the type
        kinds = sorted(set(layer_types))
        tables = [getattr(rotary, f"{k}_original_inv_freq") if hasattr(rotary, f"{k}_original_inv_freq")
                  else getattr(rotary, f"{k}_inv_freq") for k in kinds]
        scaling = [float(getattr(rotary, f"{k}_attention_scaling", 1.0)) for k in kinds]
        types = [rope[k].get("rope_type", "default") for k in kinds]
        layer_kinds = [kinds.index(t) for t in layer_types]
        theta = float(rope[kinds[0]].get("rope_theta", 10000.0))
    else:
        tables = [rotary.original_inv_freq if hasattr(rotary, "original_inv_freq") else rotary.inv_freq]
        scaling = [float(getattr(rotary, "attention_scaling", 1.0))]
        types = [rope.get("rope_type", "default")]
        layer_kinds = [0] * config.num_hidden_layers
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    max_position = 0
    if set(types) & set(_CHANGING):
        max_position = int(rope.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", 0) or config.max_position_embeddings)
    if any(t.numel() != head_dim // 2 for t in tables):
        raise UnsupportedModel(f"{config.model_type}: RoPE covers {tables[0].numel() * 2} of {head_dim} head dims "
                               "(partial rotary); not supported")
    spec = RopeSpec(tuple(tuple(float(x) for x in t.double().tolist()) for t in tables), tuple(scaling),
                    tuple(layer_kinds), max_position)
    layout = KVLayout(config.num_hidden_layers, config.num_key_value_heads, head_dim, theta, spec)
    return _plain(layout, types) or layout


def _plain(layout: KVLayout, types: list[str]) -> KVLayout | None:
    """The same layout without a spec when the model's rotation is Llama's default for its theta (so spaces
    of such models keep the fingerprints they always had)."""
    spec = layout.rope
    if spec.per_layer or spec.max_position or spec.scaling != (1.0,) or types != ["default"]:
        return None
    default = 1.0 / (layout.rope_theta ** (torch.arange(0, layout.head_dim, 2, dtype=torch.float64) / layout.head_dim))
    if not torch.allclose(torch.tensor(spec.inv_freq[0], dtype=torch.float64), default, rtol=1e-6, atol=0):
        return None
    return KVLayout(layout.num_layers, layout.kv_heads, layout.head_dim, layout.rope_theta)
