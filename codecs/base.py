"""The codec interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from scd_store.codecs.head_share import HeadShare
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.paged import PagedCaches, check_fit, scatter_eager
from scd_store.codecs.tensor_pack import PayloadError, json_int


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
               dtype: torch.dtype = torch.float32, expect_tokens: int | None = None) -> KVState:
        """Rebuild KV from ``payload`` (bytes, or a 1-D uint8 tensor on any device); raises
        :class:`PayloadError` on a payload it cannot trust. ``expect_tokens`` (e.g. the token count of
        the blob header the payload came in): a payload of another token count is refused as soon as
        its header is read, before anything sized by its count is allocated (:func:`check_tokens`)."""

    def decode_into(self, payload: bytes | torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    expect_tokens: int | None = None, heads: HeadShare | None = None) -> KVState:
        """:meth:`decode` straight into ``keys`` / ``values`` ``[layers, kv_heads, tokens, head_dim]`` (any
        strides: an engine's buffers, on their device in their dtype); returns a state over them.
        Raises :class:`PayloadError` when the payload holds another number of tokens than they do (or
        than ``expect_tokens``; without it, the buffers' token count is expected). ``heads``: the buffers
        hold this share of the model's KV heads (a tensor-parallel rank's). This default decodes and
        copies; codecs that can write in place override it."""
        state = self.decode(payload, device=keys.device, dtype=keys.dtype,
                            expect_tokens=buffer_tokens(keys, expect_tokens))
        state = heads.narrow(state) if heads is not None else state
        check_buffers(state.keys.shape, keys, values)
        keys.copy_(state.keys)
        values.copy_(state.values)
        return KVState(keys, values, start=state.start)

    def decode_paged(self, payload: bytes | torch.Tensor, caches: PagedCaches, slots: torch.Tensor,
                     expect_tokens: int | None = None, heads: HeadShare | None = None) -> int:
        """:meth:`decode` written into paged ``caches`` (an engine's blocks, on their device in their dtype): token
        ``t`` at cache slot ``slots[t]`` (``[tokens]`` int64 on the caches' device; below 0: not written, e.g. a
        token the engine already holds). Returns the tokens decoded. Everything is checked before anything is
        written: :class:`PayloadError` for a payload of another token count than ``slots`` (or
        ``expect_tokens``), ``ValueError`` for caches that cannot take it. ``heads``: the caches hold this
        share of the model's KV heads. This default decodes, then scatters; codecs that can write in
        place override it."""
        tokens = slots.shape[0] if expect_tokens is None and slots.dim() == 1 else expect_tokens
        state = self.decode(payload, device=caches.device, dtype=caches.dtype, expect_tokens=tokens)
        state = heads.narrow(state) if heads is not None else state
        check_fit(state.keys.shape, caches, slots)
        scatter_eager(state.keys, state.values, caches, slots)
        return state.num_tokens


def kv_shape(meta: dict, codec_id: str, expect_tokens: int | None, bits: int | None = None) -> list[int]:
    """A baseline payload's ``[layers, heads, tokens, head_dim]`` (JSON integers, none negative; ``bits``
    equal to the header's when given), its token count checked against ``expect_tokens`` before anything
    sized by it is allocated. Raises ``ValueError`` / ``KeyError`` / :class:`PayloadError`."""
    shape = meta["shape"]
    if not isinstance(shape, list) or len(shape) != 4 or (bits is not None and json_int(meta["bits"], "bits") != bits):
        raise ValueError("bit width or shape mismatch")
    shape = [json_int(s, f"{codec_id} payload dimension") for s in shape]
    if min(shape) < 0:
        raise ValueError(f"negative dimension in {shape}")
    check_tokens(shape[2], expect_tokens)
    return shape


def check_tokens(tokens: int, expect_tokens: int | None) -> None:
    """Raise :class:`PayloadError` when a payload's header claims ``tokens`` tokens and the caller was
    told ``expect_tokens`` (None: no expectation). Codecs call it right after parsing the header."""
    if expect_tokens is not None and tokens != expect_tokens:
        raise PayloadError(f"payload claims {tokens} tokens, {expect_tokens} were expected: refused before decoding")


def buffer_tokens(keys: torch.Tensor, expect_tokens: int | None) -> int | None:
    """``expect_tokens``, or the token count of ``[layers, kv_heads, tokens, head_dim]`` buffers without it."""
    if expect_tokens is None and keys.dim() == 4:
        return keys.shape[2]
    return expect_tokens


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
