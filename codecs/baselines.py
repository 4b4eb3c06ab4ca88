"""Baseline codecs on the producer's raw KV: ``raw`` (fp16 / bf16) and KIVI-style ``int8`` / ``int4`` /
``int2``.

They carry no consumer adaptation: decoding gives the producer's KV back (up to quantisation).
Hidden states in a :class:`KVState` are not carried.
"""

from __future__ import annotations

import torch

from scd_store.codecs.base import Codec, check_tokens, kv_shape
from scd_store.codecs.group_quant import Quantized, dequantize, quantize
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.tensor_pack import PayloadError, pack, unpack


class RawCodec(Codec):
    """The producer's KV as 16-bit floats."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"raw codec stores float16 or bfloat16, not {dtype}")
        self.dtype = dtype
        self.codec_id = "raw" if dtype == torch.float16 else "raw-bf16"

    def encode(self, state: KVState) -> bytes:
        return pack(self.codec_id, {}, {"keys": state.keys.to(self.dtype), "values": state.values.to(self.dtype)})

    def decode(self, payload: bytes | torch.Tensor, *, device="cpu", dtype=torch.float32,
               expect_tokens: int | None = None) -> KVState:
        _, _, tensors = unpack(payload, self.codec_id)
        try:
            keys, values = tensors["keys"], tensors["values"]
            if keys.dim() != 4 or keys.shape != values.shape:
                raise PayloadError(f"raw payload holds keys {tuple(keys.shape)} and values {tuple(values.shape)}")
            check_tokens(keys.shape[2], expect_tokens)  # before converting: that allocates
            return KVState(keys.to(device=device, dtype=dtype), values.to(device=device, dtype=dtype))
        except (KeyError, ValueError) as exc:
            if isinstance(exc, PayloadError):
                raise
            raise PayloadError(f"raw payload does not hold valid KV: {exc}") from None


class KiviCodec(Codec):
    """Group quantisation in the KIVI style: keys per channel (groups along tokens), values per token
    (groups along channels). Scales and offsets are fp16, one pair per group."""

    KEY_AXIS, VALUE_AXIS = 2, 3  # [layers, heads, tokens, head_dim]

    def __init__(self, bits: int, key_group: int = 32, value_group: int = 64):
        if bits not in (2, 4, 8):
            raise ValueError(f"KIVI codec supports 2, 4 or 8 bits, not {bits}")
        self.bits, self.key_group, self.value_group = bits, key_group, value_group
        self.codec_id = f"int{bits}"

    def encode(self, state: KVState) -> bytes:
        multiple = 8 // self.bits
        value_group = min(self.value_group, -(-state.head_dim // multiple) * multiple)
        k = quantize(state.keys, self.KEY_AXIS, self.key_group, self.bits)
        v = quantize(state.values, self.VALUE_AXIS, value_group, self.bits)
        meta = {"shape": list(state.keys.shape), "bits": self.bits}
        return pack(self.codec_id, meta, {
            "k_codes": k.codes, "k_scale": k.scale, "k_offset": k.offset,
            "v_codes": v.codes, "v_scale": v.scale, "v_offset": v.offset,
        })

    def decode(self, payload: bytes | torch.Tensor, *, device="cpu", dtype=torch.float32,
               expect_tokens: int | None = None) -> KVState:
        _, meta, t = unpack(payload, self.codec_id)
        try:
            shape = kv_shape(meta, self.codec_id, expect_tokens, self.bits)  # before dequantising: that allocates
            keys = dequantize(Quantized(t["k_codes"], t["k_scale"], t["k_offset"]), self.KEY_AXIS,
                              shape[self.KEY_AXIS], self.bits, 4)
            values = dequantize(Quantized(t["v_codes"], t["v_scale"], t["v_offset"]), self.VALUE_AXIS,
                                shape[self.VALUE_AXIS], self.bits, 4)
            if list(keys.shape) != shape or list(values.shape) != shape:
                raise ValueError(f"decoded shapes {tuple(keys.shape)} / {tuple(values.shape)} != {shape}")
        except (KeyError, IndexError, ValueError, RuntimeError, TypeError) as exc:
            if isinstance(exc, PayloadError):
                raise
            raise PayloadError(f"{self.codec_id} payload is inconsistent: {exc}") from None
        return KVState(keys.to(device=device, dtype=dtype), values.to(device=device, dtype=dtype))
