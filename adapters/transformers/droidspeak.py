"""A DroidSpeak-style baseline: the consumer recomputes a contiguous group of layers and reuses the
producer's raw KV everywhere else.

The payload holds the producer's raw fp16 KV of every layer outside the group and the fp16
residual stream entering the group's first layer; decoding runs the consumer's own layers of the
group on that residual (so their KV is the consumer's, computed from the producer's hidden state).
The group is chosen on calibration text by :func:`select_group`, never on evaluation windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from scd_store.adapters.transformers.capture import decoder_layers, prefill_capture
from scd_store.adapters.transformers.compat import cache_kwarg
from scd_store.adapters.transformers.inject import continue_with_prefix, mean_kl
from scd_store.codecs.base import Codec
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.tensor_pack import PayloadError, json_int, pack, unpack

CODEC_ID = "droidspeak"


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers ``start .. stop - 1``, recomputed by the consumer."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"invalid layer group [{self.start}, {self.stop})")

    @property
    def size(self) -> int:
        return self.stop - self.start

    def outside(self, num_layers: int) -> list[int]:
        return [i for i in range(num_layers) if not self.start <= i < self.stop]


@torch.no_grad()
def recompute_group(model: nn.Module, residual: torch.Tensor, group: LayerGroup, start: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """KV ``[group.size, H, T, D]`` of ``model``'s layers in ``group`` run on ``residual`` ``[T, hidden]``
    (the residual stream entering ``group.start``). Runs only those layers: the decoder's layer list
    is swapped for the group's slice for the call (not re-entrant)."""
    inner = model.model
    layers = decoder_layers(model)
    if group.stop > len(layers):
        raise ValueError(f"layer group [{group.start}, {group.stop}) exceeds the model's {len(layers)} layers")
    param = next(model.parameters())
    cache = DynamicCache()  # full KV in every layer (sliding-window layers too; their masks still slide)
    positions = torch.arange(start, start + residual.shape[0], device=param.device)[None]
    inner.layers = nn.ModuleList(list(layers)[group.start:group.stop])
    try:
        inner(inputs_embeds=residual.to(device=param.device, dtype=param.dtype)[None], position_ids=positions,
              **{cache_kwarg(inner): cache}, use_cache=True)
    finally:
        inner.layers = layers
    keys = torch.stack([cache.layers[i].keys[0] for i in range(group.start, group.stop)])
    values = torch.stack([cache.layers[i].values[0] for i in range(group.start, group.stop)])
    return keys, values


class DroidSpeakCodec(Codec):
    """Encodes a producer state captured with ``residual_layers=[group.start]``; decodes by running
    ``consumer``'s layers of ``group``."""

    codec_id = CODEC_ID

    def __init__(self, consumer: nn.Module, group: LayerGroup):
        num_layers = len(decoder_layers(consumer))
        if group.stop > num_layers:
            raise ValueError(f"layer group [{group.start}, {group.stop}) exceeds the consumer's {num_layers} layers")
        self.consumer, self.group, self.num_layers = consumer, group, num_layers

    def encode(self, state: KVState) -> bytes:
        if self.group.start not in state.residual:
            raise ValueError(f"droidspeak needs the residual entering layer {self.group.start}: capture with "
                             f"residual_layers=[{self.group.start}]")
        if state.num_layers != self.num_layers:
            raise ValueError(f"state has {state.num_layers} layers, the consumer {self.num_layers}")
        outside = self.group.outside(self.num_layers)
        tensors = {"keys": state.keys[outside].half(), "values": state.values[outside].half(),
                   "residual": state.residual[self.group.start].half()}
        meta = {"start": state.start, "group": [self.group.start, self.group.stop]}
        return pack(CODEC_ID, meta, tensors)

    def decode(self, payload: bytes, *, device="cpu", dtype=torch.float32, expect_tokens: int | None = None
               ) -> KVState:
        _, meta, t = unpack(payload, CODEC_ID)
        try:
            if list(meta["group"]) != [self.group.start, self.group.stop]:
                raise PayloadError(f"payload recomputes layers {meta['group']}, this codec "
                                   f"[{self.group.start}, {self.group.stop})")
            start = json_int(meta["start"], "droidspeak start")
            keys_out, values_out, residual = t["keys"], t["values"], t["residual"]
            if expect_tokens is not None and keys_out.dim() == 4 and keys_out.shape[2] != expect_tokens:
                raise PayloadError(f"payload holds {keys_out.shape[2]} tokens; {expect_tokens} were expected")
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, PayloadError):
                raise
            raise PayloadError(f"droidspeak payload is inconsistent: {exc}") from None
        outside = self.group.outside(self.num_layers)
        if keys_out.dim() != 4 or keys_out.shape[0] != len(outside) or keys_out.shape != values_out.shape \
                or residual.dim() != 2 or residual.shape[0] != keys_out.shape[2]:
            raise PayloadError("droidspeak payload tensors have inconsistent shapes")
        group_keys, group_values = recompute_group(self.consumer, residual.float(), self.group, start)
        shape = (self.num_layers, *keys_out.shape[1:])
        keys = torch.empty(shape, device=device, dtype=dtype)
        values = torch.empty(shape, device=device, dtype=dtype)
        keys[outside], values[outside] = keys_out.to(device, dtype), values_out.to(device, dtype)
        keys[self.group.start:self.group.stop] = group_keys.to(device, dtype)
        values[self.group.start:self.group.stop] = group_values.to(device, dtype)
        return KVState(keys, values, start=start)


@torch.no_grad()
def select_group(producer: nn.Module, consumer: nn.Module, windows: Sequence[torch.Tensor], prefix_tokens: int,
                 size: int, stride: int = 1) -> tuple[LayerGroup, dict[int, float]]:
    """The group of ``size`` layers whose recomputation gives the lowest mean KL to the consumer's own
    prefill on ``windows`` (calibration text: ``prefix_tokens`` cached, the rest scored). Returns the
    group and the KL per candidate start."""
    num_layers = len(decoder_layers(consumer))
    if not 0 < size <= num_layers:
        raise ValueError(f"group size {size} outside 1..{num_layers}")
    starts = list(range(0, num_layers - size + 1, stride))
    if starts[-1] != num_layers - size:
        starts.append(num_layers - size)
    kl = dict.fromkeys(starts, 0.0)
    for window in windows:
        prefix, feed = window[:prefix_tokens], window[prefix_tokens:]
        own, _ = prefill_capture(consumer, prefix)
        oracle = continue_with_prefix(consumer, own, feed)
        produced, _ = prefill_capture(producer, prefix, residual_layers=starts)
        for a in starts:
            group = LayerGroup(a, a + size)
            keys, values = produced.keys.clone(), produced.values.clone()
            keys[a:a + size], values[a:a + size] = recompute_group(consumer, produced.residual[a], group)
            logits = continue_with_prefix(consumer, KVState(keys, values), feed)
            kl[a] += mean_kl(logits, oracle) / len(windows)
    best = min(kl, key=kl.get)
    return LayerGroup(best, best + size), kl
