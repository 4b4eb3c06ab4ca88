"""Model geometry shared by a code space and its decoders, and the KV <-> feature reshaping.

A *feature* row holds one token's pre-RoPE key (or value) of one layer with the KV heads
concatenated: ``C = kv_heads * head_dim`` numbers. Groups are ``2 * layers``: group ``2l`` is layer
``l``'s keys, ``2l + 1`` its values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.rope import RopeSpec, apply_rope, invert_rope, rope_cos_sin, rotate_into
from scd_store.codecs.tensor_pack import json_int, json_number


@dataclass(frozen=True, slots=True, repr=False)
class KVLayout:
    """Geometry of a model's KV cache (all models of a code space share it) and its keys' rotation:
    Llama's default RoPE of base ``rope_theta``, or ``rope`` (scaled frequencies, per-layer kinds)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rope: RopeSpec | None = None

    def __post_init__(self) -> None:
        if min(self.num_layers, self.kv_heads, self.head_dim) <= 0 or self.head_dim % 2:
            raise ValueError(f"invalid KV layout {self}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        rope = self.rope
        if rope is not None and (len(rope.layer_kinds), len(rope.inv_freq[0])) != (self.num_layers, self.head_dim // 2):
            raise ValueError(f"RoPE spec of {len(rope.layer_kinds)} layers x {len(rope.inv_freq[0])} frequencies does "
                             f"not fit {self.num_layers} layers of head_dim {self.head_dim}")

    def __repr__(self) -> str:  # part of every space's fingerprint: unchanged for the default rotation
        base = (f"KVLayout(num_layers={self.num_layers}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"rope_theta={self.rope_theta!r}")
        return base + (f", rope={self.rope.to_dict()})" if self.rope is not None else ")")

    def to_dict(self) -> dict:
        data = {"num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "rope_theta": self.rope_theta}
        return data if self.rope is None else {**data, "rope": self.rope.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> KVLayout:
        """The layout of :meth:`to_dict` (a manifest's): integers and finite numbers only, never coerced;
        raises ``ValueError`` (or ``KeyError`` for a missing field)."""
        rope = data.get("rope")
        sizes = (json_int(data[name], f"layout {name}", ValueError) for name in ("num_layers", "kv_heads", "head_dim"))
        return cls(*sizes, json_number(data["rope_theta"], "layout rope_theta", ValueError),
                   RopeSpec.from_dict(rope) if rope is not None else None)

    @property
    def per_layer_rope(self) -> bool:
        """Whether layers rotate keys differently (RoPE tables are then ``[layers, 1, T, D]``)."""
        return self.rope is not None and self.rope.per_layer

    def angles(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32, inverse: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` of the keys' rotation at ``positions`` (``inverse``: the un-rotation's)."""
        if self.rope is None:
            return rope_cos_sin(positions, self.head_dim, self.rope_theta, dtype=dtype)
        return self.rope.cos_sin(positions, dtype, inverse)

    def check_positions(self, start: int, tokens: int) -> None:
        """Raise ``ValueError`` when positions ``start..start + tokens`` pass where the rotation is known."""
        limit = self.rope.max_position if self.rope is not None else 0
        if limit and start + tokens > limit:
            raise ValueError(f"positions up to {start + tokens} pass {limit}, past which this model's RoPE "
                             "(dynamic / longrope) changes its frequencies: not coded")

    @property
    def groups(self) -> int:
        return 2 * self.num_layers

    @property
    def width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def geometry(self) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)``: what an engine's KV must match."""
        return self.num_layers, self.kv_heads, self.head_dim

    @property
    def fp16_bytes_per_token(self) -> int:
        """Raw fp16 K and V bytes of one token over all layers: the reference for payload ratios."""
        return 2 * self.num_layers * self.width * 2

    def check(self, state: KVState, owner: str = "the code space") -> None:
        """Raise ``ValueError`` unless ``state`` has this geometry (``owner`` names who expects it)."""
        got = (state.num_layers, state.num_kv_heads, state.head_dim)
        if got != self.geometry:
            raise ValueError(f"{owner}: KV of (layers, kv_heads, head_dim) {got}, calibrated for {self.geometry}")


def to_features(state: KVState, layout: KVLayout) -> torch.Tensor:
    """``[T, groups, C]`` float32 features: keys un-rotated to pre-RoPE, heads concatenated."""
    layout.check(state)
    layout.check_positions(state.start, state.num_tokens)
    cos, sin = layout.angles(state.positions, inverse=True)
    keys = invert_rope(state.keys.float(), cos, sin)
    t = state.num_tokens
    k = keys.permute(2, 0, 1, 3).reshape(t, layout.num_layers, layout.width)
    v = state.values.float().permute(2, 0, 1, 3).reshape(t, layout.num_layers, layout.width)
    return torch.stack([k, v], dim=2).reshape(t, layout.groups, layout.width)


def from_features(features: torch.Tensor, layout: KVLayout, start: int) -> KVState:
    """Invert :func:`to_features` at positions ``start..``: rotate keys, split heads."""
    t = features.shape[0]
    f = features.reshape(t, layout.num_layers, 2, layout.kv_heads, layout.head_dim)
    keys = f[:, :, 0].permute(1, 2, 0, 3)
    values = f[:, :, 1].permute(1, 2, 0, 3)
    positions = torch.arange(start, start + t, device=features.device)
    cos, sin = layout.angles(positions, dtype=features.dtype)
    return KVState(apply_rope(keys, cos, sin).contiguous(), values.contiguous(), start=start)


def write_token_major(features: torch.Tensor, layout: KVLayout, cos: torch.Tensor, sin: torch.Tensor,
                      keys_out: torch.Tensor, values_out: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
    """The inference form of :func:`from_features`: write ``[2 * L', T, C]`` features of ``L'``
    consecutive layers (as a batched matmul produces them) into ``keys_out`` / ``values_out``
    ``[L', H, T, D]`` (any strides), moving heads and rotating keys in one pass per tensor.
    ``cos`` / ``sin`` are the tokens' RoPE half tables (:meth:`RopeTable.halves`). Features in
    another dtype than ``cos`` (bf16 products) have their keys widened into ``scratch`` first (at least
    ``L' * T * C`` elements of ``cos``'s dtype): one conversion instead of a temporary per rotation op."""
    groups, t, _ = features.shape
    f = features.view(groups // 2, 2, t, layout.kv_heads, layout.head_dim)
    keys = f[:, 0]
    if scratch is not None and keys.dtype != cos.dtype:
        keys = scratch[:keys.numel()].view(keys.shape).copy_(keys)
    rotate_into(keys_out, keys.permute(0, 2, 1, 3), cos, sin)
    values_out.copy_(f[:, 1].permute(0, 2, 1, 3))
