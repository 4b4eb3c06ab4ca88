"""A KVQuant-style baseline at 2 bits ("kvq2"), without calibration ("lite"): every byte it needs travels in
its payload.

- Keys are quantised before RoPE (un-rotated with the model's rotation, re-rotated on decode), per
  channel: each (layer, head, channel) gets 4 non-uniform levels, the centres of its values' quartiles
  (fp16 each), and every key its nearest level.
- Values are quantised per token: 4 uniform levels between each (layer, head, token) vector's min and
  max (fp16 scale and offset).
- Outliers: the 1% of each tensor's elements furthest from their channel's (keys) or token's (values)
  median are kept exactly (int32 flat index + fp16 value) and left out of the levels.
"""

from __future__ import annotations

import torch

from scd_store.codecs.base import Codec, kv_shape
from scd_store.codecs.group_quant import Quantized, dequantize, quantize
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.rotated import pack_bits, unpack_bits
from scd_store.codecs.scd.layout import KVLayout
from scd_store.codecs.scd.rope import apply_rope, invert_rope
from scd_store.codecs.tensor_pack import PayloadError, json_int, pack, unpack

OUTLIERS = 0.01
CODEC_ID = "kvq2"


def _outliers(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Flat indices of the ``OUTLIERS`` share of ``x``'s elements furthest from their median along ``dim``."""
    distance = (x - x.median(dim=dim, keepdim=True).values).abs().flatten()
    count = int(OUTLIERS * distance.numel())
    return distance.topk(count).indices.sort().values if count else torch.zeros(0, dtype=torch.int64)


def _key_levels(keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per (layer, head, channel) the centres of its inlier values' quartiles ``[L, H, 4, D]``."""
    qs = torch.tensor([0.125, 0.375, 0.625, 0.875], dtype=keys.dtype, device=keys.device)
    filled = torch.where(mask, torch.full_like(keys, float("nan")), keys)
    return torch.nanquantile(filled.transpose(2, 3).flatten(0, 2), qs, dim=-1).permute(1, 0).reshape(
        keys.shape[0], keys.shape[1], keys.shape[3], 4).transpose(2, 3)


class KVQuantLiteCodec(Codec):
    """Pre-RoPE per-channel non-uniform 2-bit keys, per-token 2-bit values, 1% exact outliers."""

    codec_id = CODEC_ID

    def __init__(self, layout: KVLayout):
        self.layout = layout

    def encode(self, state: KVState) -> bytes:
        self.layout.check(state, "kvq2")
        cos, sin = self.layout.angles(state.positions, inverse=True)
        keys = invert_rope(state.keys.float(), cos, sin)
        k_out = _outliers(keys, dim=2)
        k_mask = torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
        k_mask[k_out] = True
        k_mask = k_mask.view(keys.shape)
        levels = _key_levels(keys, k_mask) if state.num_tokens else torch.zeros(*keys.shape[:2], 4, keys.shape[3])
        levels = torch.nan_to_num(levels).half()
        codes = (keys.unsqueeze(3) - levels.float().unsqueeze(2)).abs().argmin(3).to(torch.uint8)  # [L, H, T, D]
        values = state.values.float()
        v_out = _outliers(values, dim=3)
        v_in = values.clone().flatten()
        v_in[v_out] = values.median(dim=3, keepdim=True).values.expand_as(values).flatten()[v_out]
        v = quantize(v_in.view(values.shape), 3, -(-state.head_dim // 4) * 4, 2)
        meta = {"shape": list(state.keys.shape), "start": state.start}
        return pack(self.codec_id, meta, {
            "k_codes": pack_bits(codes.flatten(), 2), "k_levels": levels.contiguous(),
            "k_out_index": k_out.to(torch.int32), "k_out_value": keys.flatten()[k_out].half(),
            "v_codes": v.codes, "v_scale": v.scale, "v_offset": v.offset,
            "v_out_index": v_out.to(torch.int32), "v_out_value": values.flatten()[v_out].half()})

    def decode(self, payload: bytes | torch.Tensor, *, device="cpu", dtype=torch.float32,
               expect_tokens: int | None = None) -> KVState:
        _, meta, t = unpack(payload, self.codec_id)
        try:
            shape = kv_shape(meta, self.codec_id, expect_tokens)  # before unpacking: that allocates
            start = json_int(meta["start"], "kvq2 payload start")
            if start < 0 or tuple(shape[i] for i in (0, 1, 3)) != self.layout.geometry:
                raise ValueError(f"shape {shape} does not fit the layout {self.layout.geometry}")
            n = shape[0] * shape[1] * shape[2] * shape[3]
            codes = unpack_bits(t["k_codes"], 2, n).view(shape).long()
            levels = t["k_levels"].float()
            if list(levels.shape) != [shape[0], shape[1], 4, shape[3]]:
                raise ValueError("key levels do not fit the shape")
            keys = levels.unsqueeze(2).expand(*shape[:3], 4, shape[3]).gather(3, codes.unsqueeze(3)).squeeze(3)
            values = dequantize(Quantized(t["v_codes"], t["v_scale"], t["v_offset"]), 3, shape[3], 2, 4)
            if list(values.shape) != shape:
                raise ValueError("values do not fit the shape")
            for x, index, value in ((keys, t["k_out_index"], t["k_out_value"]),
                                    (values, t["v_out_index"], t["v_out_value"])):
                index = index.long()
                if index.numel() != value.numel() or (index.numel() and (index.min() < 0 or index.max() >= n)):
                    raise ValueError("outliers outside the tensor")
                x.view(-1)[index] = value.float()
            positions = torch.arange(start, start + shape[2])
            cos, sin = self.layout.angles(positions)
            keys = apply_rope(keys, cos, sin)
        except (KeyError, IndexError, ValueError, RuntimeError, TypeError) as exc:
            if isinstance(exc, PayloadError):
                raise
            raise PayloadError(f"kvq2 payload is inconsistent: {exc}") from None
        return KVState(keys.to(device=device, dtype=dtype).contiguous(), values.to(device=device, dtype=dtype),
                       start=start)
