"""The SCD codec: a code space's encoder and one consumer's decoder behind the codec interface."""

from __future__ import annotations

import torch

from scd_store.codecs.base import Codec
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.layout import write_token_major
from scd_store.codecs.scd.patch import apply_patches
from scd_store.codecs.scd.rope import RopeTable
from scd_store.codecs.scd.space import CODEC_ID, CodeSpace


class ScdCodec(Codec):
    """Encodes with ``space``; decodes into ``decoder``'s consumer KV (REUSE).

    Decoding is one batched matmul over all layers and tensors (integer codes in, consumer
    features out, only the components that carry bits), then one pass that moves heads and
    rotates keys straight into the output cache tensors.
    """

    codec_id = CODEC_ID

    def __init__(self, space: CodeSpace, decoder: PairDecoder | None = None):
        if decoder is not None and decoder.space_fingerprint != space.fingerprint:
            raise ValueError(f"decoder of {decoder.consumer} belongs to another code space")
        if decoder is not None:
            hidden = sorted(p.layer for p in decoder.patches if p.source == "hidden")
            if hidden != sorted(space.patch_layers):
                raise ValueError(f"decoder of {decoder.consumer} patches H_in at layers {hidden}, the code space "
                                 f"codes H_in at {sorted(space.patch_layers)}")
        self.space = space
        self.decoder = decoder
        self._rope = RopeTable(space.layout.head_dim, space.layout.rope_theta)
        self._matrices: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._patches: dict[str, list] = {}

    def encode(self, state: KVState) -> bytes:
        return self.space.encode(state)

    def _folded(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's folded matrices cut to the components that carry bits, contiguous."""
        key = (str(device), dtype)
        if key not in self._matrices:
            matrix, offset = self.decoder.folded(self.space, device, dtype)
            active = self.space.active_components
            self._matrices[key] = (matrix[:, :active].contiguous(), offset.unsqueeze(1).contiguous())
        return self._matrices[key]

    def _apply_patches(self, features: torch.Tensor, codes, device) -> None:
        """Overwrite the patch layers' groups of ``features`` ``[G, T, C]`` with the aligners' K / V."""
        key = str(device)
        if key not in self._patches:
            self._patches[key] = [p.to(device) for p in self.decoder.patches]
        hidden = None
        if self.space.hidden is not None:
            hidden = self.space.hidden.reconstruct(codes.hidden_codes)  # [T, P, D]
        groups = list(features.unbind(0))
        with torch.no_grad():
            apply_patches(groups, self._patches[key], hidden, self.space.patch_layers)
        for patch in self._patches[key]:
            for group in (2 * patch.layer, 2 * patch.layer + 1):
                features[group] = groups[group]

    def decode(self, payload: bytes, *, device="cpu", dtype=torch.float32) -> KVState:
        if self.decoder is None:
            raise ValueError("this SCD codec has no consumer decoder: it can encode only")
        codes = self.space.unpack(payload, device=device)
        layout = self.space.layout
        sinks = codes.sinks.num_tokens if codes.sinks is not None else 0
        shape = (layout.num_layers, layout.kv_heads, codes.num_tokens, layout.head_dim)
        keys = torch.empty(shape, device=device, dtype=dtype)
        values = torch.empty(shape, device=device, dtype=dtype)
        if sinks:
            keys[:, :, :sinks] = codes.sinks.keys
            values[:, :, :sinks] = codes.sinks.values
        coded = codes.num_tokens - sinks
        if coded:
            matrix, offset = self._folded(device, torch.float32)
            active = matrix.shape[1]
            by_component = codes.codes.t().reshape(layout.groups, layout.width, coded)
            q = by_component[:, :active].to(torch.float32)  # [G, active, T]
            features = torch.baddbmm(offset, q.transpose(1, 2), matrix)  # [G, T, C]
            if self.decoder.patches:
                self._apply_patches(features, codes, device)
            write_token_major(features, layout, codes.start + sinks, self._rope, keys[:, :, sinks:],
                              values[:, :, sinks:])
        return KVState(keys, values, start=codes.start)
