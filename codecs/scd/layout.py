"""Model geometry shared by a code space and its decoders, and the KV <-> feature reshaping.

A *feature* row holds one token's pre-RoPE key (or value) of one layer with the KV heads
concatenated: ``C = kv_heads * head_dim`` numbers. Groups are ``2 * layers``: group ``2l`` is layer
``l``'s keys, ``2l + 1`` its values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.rope import apply_rope, invert_rope, rope_cos_sin, rotate_into


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of a model's KV cache (all models of a code space share it)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    rope_theta: float

    def __post_init__(self) -> None:
        if min(self.num_layers, self.kv_heads, self.head_dim) <= 0 or self.head_dim % 2:
            raise ValueError(f"invalid KV layout {self}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")

    @property
    def groups(self) -> int:
        return 2 * self.num_layers

    @property
    def width(self) -> int:
        return self.kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

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
    cos, sin = rope_cos_sin(state.positions, layout.head_dim, layout.rope_theta)
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
    cos, sin = rope_cos_sin(positions, layout.head_dim, layout.rope_theta, dtype=features.dtype)
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
