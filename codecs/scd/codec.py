"""The SCD codec: a code space's encoder and one consumer's decoder behind the codec interface."""

from __future__ import annotations

import torch

from scd_store.codecs.base import Codec
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.layout import from_features
from scd_store.codecs.scd.space import CODEC_ID, CodeSpace
from scd_store.codecs.tensor_pack import PayloadError


class ScdCodec(Codec):
    """Encodes with ``space``; decodes into ``decoder``'s consumer KV (REUSE)."""

    codec_id = CODEC_ID

    def __init__(self, space: CodeSpace, decoder: PairDecoder | None = None):
        if decoder is not None and decoder.space_fingerprint != space.fingerprint:
            raise ValueError(f"decoder of {decoder.consumer} belongs to another code space")
        self.space = space
        self.decoder = decoder

    def encode(self, state: KVState) -> bytes:
        return self.space.encode(state)

    def decode(self, payload: bytes, *, device="cpu", dtype=torch.float32) -> KVState:
        if self.decoder is None:
            raise ValueError("this SCD codec has no consumer decoder: it can encode only")
        codes = self.space.unpack(payload, device=device)
        sinks = codes.sinks.num_tokens if codes.sinks is not None else 0
        matrix, offset = self.decoder.folded(self.space, device, torch.float32)
        q = codes.codes.view(-1, self.space.layout.groups, self.space.layout.width).transpose(0, 1).float()
        features = torch.baddbmm(offset.unsqueeze(1), q, matrix).transpose(0, 1)
        coded = from_features(features, self.space.layout, start=codes.start + sinks)
        if codes.sinks is None:
            return coded.to(dtype=dtype)
        keys = torch.cat([codes.sinks.keys.float(), coded.keys], dim=2)
        values = torch.cat([codes.sinks.values.float(), coded.values], dim=2)
        if keys.shape[2] != codes.num_tokens:
            raise PayloadError("decoded token count does not match the payload")
        return KVState(keys.to(dtype), values.to(dtype), start=codes.start)
