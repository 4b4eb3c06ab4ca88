"""The codec interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from scd_store.codecs.kv_state import KVState
from scd_store.codecs.tensor_pack import PayloadError


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

    def decode_into(self, payload: bytes | torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> KVState:
        """:meth:`decode` straight into ``keys`` / ``values`` ``[layers, kv_heads, tokens, head_dim]`` (any
        strides: an engine's buffers, on their device in their dtype); returns a state over them.
        Raises :class:`PayloadError` when the payload holds another number of tokens than they do.
        This default decodes and copies; codecs that can write in place override it."""
        state = self.decode(payload, device=keys.device, dtype=keys.dtype)
        check_buffers(state.keys.shape, keys, values)
        keys.copy_(state.keys)
        values.copy_(state.values)
        return KVState(keys, values, start=state.start)

    def encode_batch(self, states: list[KVState]) -> list[bytes]:
        return [self.encode(s) for s in states]

    def decode_batch(self, payloads: list[bytes], *, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> list[KVState]:
        return [self.decode(p, device=device, dtype=dtype) for p in payloads]


def check_buffers(shape: tuple[int, ...], keys: torch.Tensor, values: torch.Tensor) -> None:
    """Raise unless ``keys`` / ``values`` can take KV of ``shape``: :class:`PayloadError` when only the
    token count differs (the payload disagrees with what the caller was told), else ``ValueError``."""
    if keys.shape != values.shape or keys.dtype != values.dtype or keys.device != values.device:
        raise ValueError("key and value buffers must share shape, dtype and device")
    shape = tuple(shape)
    if tuple(keys.shape) != shape:
        if keys.dim() == 4 and len(shape) == 4 and tuple(keys.shape[:2]) + (keys.shape[3],) == shape[:2] + shape[3:]:
            raise PayloadError(f"payload decodes to {shape[2]} tokens; the buffers hold {keys.shape[2]}")
        raise ValueError(f"buffers of shape {tuple(keys.shape)} cannot take KV of shape {shape}")
