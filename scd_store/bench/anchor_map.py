"""An anchor codec plus a bundle's distilled decoder map (``bench quality --anchor-map``).

The anchors (KIVI-2, rotated scalar quantisers, KVQuant-lite, raw fp16) compress the producer's KV
but do not correct a fine-tune's drift; scd-store's codes do both. To compare the two on
compression alone, each anchor's decoded KV goes through the same map a bundle distilled for this
consumer (``y = x + x W + b`` on pre-RoPE features), tokens from the space's sink count on; the
anchor's own first tokens are kept as it decoded them. The payload is the anchor's, byte for byte.
"""

from __future__ import annotations

import torch

from scd_store.codecs.base import Codec
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.decoder import PairDecoder, apply_map
from scd_store.codecs.scd.layout import KVLayout, from_features, to_features
from scd_store.codecs.scd.space import sink_count

SUFFIX = "+map"  # an anchor method's name with a bundle's map after it


class MappedAnchor(Codec):
    """``anchor`` for the bytes, ``decoder``'s map (no PATCH aligners) for the consumer's KV."""

    def __init__(self, anchor: Codec, decoder: PairDecoder, layout: KVLayout, sink_tokens: int):
        if decoder.patches:
            raise ValueError("a PATCH decoder needs its own codes: only a REUSE map can follow an anchor")
        if tuple(decoder.bias.shape) != (layout.groups, layout.width):
            raise ValueError(f"decoder bias {tuple(decoder.bias.shape)} does not fit the layout's "
                             f"({layout.groups}, {layout.width}) features")
        self.anchor, self.decoder, self.layout, self.sink_tokens = anchor, decoder, layout, sink_tokens
        self.codec_id = f"{anchor.codec_id}{SUFFIX}"

    def encode(self, state: KVState) -> bytes:
        return self.anchor.encode(state)

    def decode(self, payload: bytes | torch.Tensor, *, device="cpu", dtype=torch.float32,
               expect_tokens: int | None = None) -> KVState:
        state = self.anchor.decode(payload, device=device, dtype=torch.float32, expect_tokens=expect_tokens)
        kept = sink_count(self.sink_tokens, state.start, state.num_tokens)
        if kept == state.num_tokens:
            return state.to(dtype=dtype)
        mapped = KVState(state.keys[:, :, kept:], state.values[:, :, kept:], start=state.start + kept)
        x = to_features(mapped, self.layout)
        weight = self.decoder.weight.to(device=x.device, dtype=x.dtype)
        y = x + apply_map(x, weight) + self.decoder.bias.to(device=x.device, dtype=x.dtype)
        out = from_features(y, self.layout, mapped.start)
        if kept:
            head = KVState(state.keys[:, :, :kept], state.values[:, :, :kept], start=state.start)
            out = KVState.cat([head, out])
        return out.to(dtype=dtype)
