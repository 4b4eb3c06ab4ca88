"""The codec interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from scd_store.codecs.kv_state import KVState


class Codec(ABC):
    """Encodes a producer's state into bytes; decodes bytes into a consumer's KV.

    A codec instance is bound to one code space (and, for decoding, to one consumer). Payloads
    are self-describing byte strings (see :mod:`tensor_pack`); never pickle.
    """

    codec_id: str = ""

    @abstractmethod
    def encode(self, state: KVState) -> bytes:
        """Serialise ``state`` into a payload."""

    @abstractmethod
    def decode(self, payload: bytes | torch.Tensor, *, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> KVState:
        """Rebuild KV from ``payload`` (bytes, or a 1-D uint8 tensor on any device); raises
        :class:`PayloadError` on a payload it cannot trust."""

    def encode_batch(self, states: list[KVState]) -> list[bytes]:
        return [self.encode(s) for s in states]

    def decode_batch(self, payloads: list[bytes], *, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> list[KVState]:
        return [self.decode(p, device=device, dtype=dtype) for p in payloads]
