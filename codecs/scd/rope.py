"""Rotary position embedding (the "rotate half" form) for keys, and its exact inverse.

Codes are kept position-independent: keys are un-rotated to pre-RoPE before coding and rotated
at their target positions after decoding. The default rotation is Llama's (one base ``theta``);
:class:`RopeSpec` holds any other a model uses: scaled frequencies (llama3, linear, yarn, NTK),
a cos / sin scaling factor (yarn's attention factor), and one kind per layer (Gemma 3's local
and global layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scd_store.codecs.device_cache import published
from scd_store.codecs.tensor_pack import json_int, json_number


def _list(value: object, what: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"RoPE {what} must be a list, got {value!r:.40}")
    return value


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Per kind of layer the inverse frequencies (``head_dim / 2``) and the factor cos / sin are scaled
    by; ``layer_kinds[l]`` is layer ``l``'s kind. ``max_position`` > 0: the rotation is known only below
    it (dynamic NTK and longrope change their frequencies past it), so KV reaching it is refused."""

    inv_freq: tuple[tuple[float, ...], ...]
    scaling: tuple[float, ...]
    layer_kinds: tuple[int, ...]
    max_position: int = 0

    def __post_init__(self) -> None:
        kinds = len(self.inv_freq)
        if not kinds or len(self.scaling) != kinds or len({len(f) for f in self.inv_freq}) != 1:
            raise ValueError("a RoPE spec needs one frequency table of one width and one scaling per kind")
        if any(not 0 <= k < kinds for k in self.layer_kinds) or not self.layer_kinds:
            raise ValueError(f"layer kinds {self.layer_kinds} must index the {kinds} frequency tables")
        if any(not s > 0 for s in self.scaling) or any(not f > 0 for t in self.inv_freq for f in t):
            raise ValueError("RoPE frequencies and scalings must be positive")
        if self.max_position < 0:
            raise ValueError(f"max_position must be >= 0, got {self.max_position}")

    @property
    def per_layer(self) -> bool:
        """Whether layers rotate differently (tables are then ``[layers, 1, T, D]``, else ``[T, D]``)."""
        return len(self.inv_freq) > 1

    def to_dict(self) -> dict:
        return {"inv_freq": [list(f) for f in self.inv_freq], "scaling": list(self.scaling),
                "layer_kinds": list(self.layer_kinds), "max_position": self.max_position}

    @classmethod
    def from_dict(cls, data: dict) -> RopeSpec:
        """The spec of :meth:`to_dict` (a manifest's): finite numbers and integers only, never coerced;
        raises ``ValueError`` (or ``KeyError`` for a missing field)."""
        if not isinstance(data, dict):
            raise ValueError("a RoPE spec must be an object")
        freq = tuple(tuple(json_number(x, "a RoPE frequency", ValueError) for x in _list(f, "inv_freq"))
                     for f in _list(data["inv_freq"], "inv_freq"))
        scaling = tuple(json_number(s, "a RoPE scaling", ValueError) for s in _list(data["scaling"], "scaling"))
        kinds = tuple(json_int(k, "a RoPE layer kind", ValueError) for k in _list(data["layer_kinds"], "layer_kinds"))
        return cls(freq, scaling, kinds, json_int(data.get("max_position", 0), "RoPE max_position", ValueError))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32, inverse: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled ``cos``, ``sin`` (``[T, D]``, or ``[layers, 1, T, D]`` per layer); ``inverse``: the tables
        :func:`invert_rope` undoes :func:`apply_rope` of the forward tables with."""
        freq = torch.tensor(self.inv_freq, dtype=torch.float64, device=positions.device)  # [K, D / 2]
        angles = positions.to(torch.float64)[None, :, None] * freq[:, None, :]
        emb = torch.cat([angles, angles], dim=-1)  # [K, T, D]
        scale = torch.tensor(self.scaling, dtype=torch.float64, device=positions.device)[:, None, None]
        scale = 1.0 / scale if inverse else scale
        cos, sin = emb.cos() * scale, emb.sin() * scale
        if not self.per_layer:
            return cos[0].to(dtype), sin[0].to(dtype)
        kinds = torch.tensor(self.layer_kinds, device=positions.device)
        return cos[kinds, None].to(dtype), sin[kinds, None].to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` of shape ``[T, head_dim]`` for integer ``positions`` ``[T]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``keys`` ``[..., T, head_dim]`` to their positions."""
    return keys * cos + _rotate_half(keys) * sin


def invert_rope(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo :func:`apply_rope` (rotation by the negative angle)."""
    return keys * cos - _rotate_half(keys) * sin


class RopeTable:
    """``cos`` / ``sin`` for positions ``0..n`` computed once per device and dtype and sliced per call
    (decoding the same prefix lengths again and again must not recompute the angles). With a per-layer
    :class:`RopeSpec` the tables are ``[layers, 1, T, D]`` (sliced along T)."""

    def __init__(self, head_dim: int, theta: float, spec: RopeSpec | None = None):
        self.head_dim, self.theta, self.spec = head_dim, theta, spec
        self._tables: dict[tuple[str, torch.dtype], tuple[torch.Tensor, ...]] = {}
        self._retired: list[tuple[torch.Tensor, ...]] = []  # outgrown tables other streams may still read

    def _table(self, end: int, device: torch.device | str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        key = (str(device), dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[-2] < end:
            size = max(1024, 1 << (end - 1).bit_length())
            positions = torch.arange(size, device=device)
            if self.spec is None:
                cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, dtype=dtype)
            else:
                cos, sin = self.spec.cos_sin(positions, dtype)
            half = self.head_dim // 2
            table = published((cos, sin, cos[..., :half].contiguous(), sin[..., :half].contiguous()), device)
            old = self._tables.get(key)
            if old is not None and torch.device(device).type == "cuda":
                self._retired.append(old)
            self._tables[key] = table
        return table

    def get(self, start: int, length: int, device: torch.device | str, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[length, head_dim]`` for positions ``start..start + length``."""
        cos, sin, _, _ = self._table(start + length, device, dtype)
        return cos[..., start:start + length, :], sin[..., start:start + length, :]

    def halves(self, start: int, length: int, device: torch.device | str, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first halves of :meth:`get` (``[length, head_dim / 2]``, both halves of a row are
        equal): what :func:`rotate_into` reads."""
        _, _, cos, sin = self._table(start + length, device, dtype)
        return cos[..., start:start + length, :], sin[..., start:start + length, :]


def rotate_into(out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` of ``keys`` (any strides) written into ``out`` without temporaries of the
    rotated halves; ``cos`` / ``sin`` are the half tables ``[T, head_dim / 2]`` of :meth:`RopeTable.halves`."""
    half = keys.shape[-1] // 2
    k1, k2 = keys[..., :half], keys[..., half:]
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(k1, cos, out=o1)
    o1.addcmul_(k2, sin, value=-1.0)
    torch.mul(k2, cos, out=o2)
    o2.addcmul_(k1, sin)
    return out
