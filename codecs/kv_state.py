"""The one face between engines and codecs: a single sequence's KV cache (and hidden states)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class KVState:
    """One sequence's prefix state, as the model caches it.

    ``keys`` and ``values`` are ``[num_layers, num_kv_heads, num_tokens, head_dim]``; keys are
    post-RoPE at absolute positions ``start .. start + num_tokens - 1``. ``hidden`` optionally
    maps a layer index to that layer's normalised pre-attention input ``H_in`` of shape
    ``[num_tokens, hidden_size]``; ``residual`` likewise maps a layer index to the residual stream
    entering that layer (the decoder layer's input, before its norm).
    """

    keys: torch.Tensor
    values: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    start: int = 0
    residual: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.keys.dim() != 4:
            raise ValueError(f"keys must be [layers, kv_heads, tokens, head_dim], got shape {tuple(self.keys.shape)}")
        if self.keys.shape != self.values.shape:
            raise ValueError(f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} differ in shape")
        if self.keys.dtype != self.values.dtype or self.keys.device != self.values.device:
            raise ValueError("keys and values must share dtype and device")
        if self.start < 0:
            raise ValueError(f"start position must be >= 0, got {self.start}")
        if not self.keys.is_floating_point():
            raise ValueError(f"keys must be floating point, got {self.keys.dtype}")
        for kind, states in (("hidden", self.hidden), ("residual", self.residual)):
            for layer, h in states.items():
                if not 0 <= layer < self.num_layers:
                    raise ValueError(f"{kind} state for layer {layer} outside 0..{self.num_layers - 1}")
                if h.dim() != 2 or h.shape[0] != self.num_tokens:
                    raise ValueError(f"{kind} state of layer {layer} must be [{self.num_tokens}, hidden], "
                                     f"got {tuple(h.shape)}")

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[3]

    def fp16_bytes(self) -> int:
        """Bytes this KV takes as raw fp16: the reference for payload ratios."""
        return 2 * self.keys.numel() * 2

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> KVState:
        hidden = {i: h.to(device=device, dtype=dtype) for i, h in self.hidden.items()}
        residual = {i: h.to(device=device, dtype=dtype) for i, h in self.residual.items()}
        return KVState(self.keys.to(device=device, dtype=dtype), self.values.to(device=device, dtype=dtype), hidden,
                       self.start, residual)

    @classmethod
    def cat(cls, states: list[KVState]) -> KVState:
        """Consecutive states (chunks of one sequence, in order) as one, from the first one's start."""
        if not states:
            raise ValueError("no states to join")
        for before, after in zip(states, states[1:], strict=False):
            if after.start != before.start + before.num_tokens:
                raise ValueError(f"states are not consecutive: one ends at {before.start + before.num_tokens}, "
                                 f"the next starts at {after.start}")
        return cls(torch.cat([s.keys for s in states], 2), torch.cat([s.values for s in states], 2),
                   start=states[0].start)

    @property
    def positions(self) -> torch.Tensor:
        """Absolute positions of the tokens, ``[num_tokens]``."""
        return torch.arange(self.start, self.start + self.num_tokens, device=self.keys.device)
