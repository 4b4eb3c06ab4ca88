import pytest
import torch

from scd_store.codecs import KVState, PayloadError, make_codec
from scd_store.codecs.kvquant import KVQuantLiteCodec
from scd_store.codecs.rotated import pack_bits
from scd_store.codecs.scd.layout import KVLayout
from scd_store.codecs.scd.rope import apply_rope
from scd_store.codecs.tensor_pack import pack, unpack

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=16, rope_theta=1e4)


def _state(tokens: int = 96, start: int = 7, seed: int = 0) -> KVState:
    gen = torch.Generator().manual_seed(seed)
    pre = torch.randn(2, 2, tokens, 16, generator=gen) * torch.linspace(0.2, 4, 16)  # per-channel scales
    pre[..., 3] += 25.0  # an outlier channel, as keys have
    cos, sin = LAYOUT.angles(torch.arange(start, start + tokens))
    return KVState(apply_rope(pre, cos, sin), torch.randn(2, 2, tokens, 16, generator=gen), start=start)


def test_round_trip_is_close_and_costs_about_two_bits_plus_outliers():
    state = _state()
    codec = KVQuantLiteCodec(LAYOUT)
    payload = codec.encode(state)
    out = codec.decode(payload)
    assert out.start == state.start and out.keys.shape == state.keys.shape
    key_err = float((out.keys - state.keys).pow(2).sum() / state.keys.pow(2).sum())
    value_err = float((out.values - state.values).pow(2).sum() / state.values.pow(2).sum())
    kivi = make_codec("int2").decode(make_codec("int2").encode(state))
    kivi_err = float((kivi.keys - state.keys).pow(2).sum() / state.keys.pow(2).sum())
    assert key_err < 0.03 and value_err < 0.2 and key_err < kivi_err  # levels fitted pre-RoPE, per channel
    bits = 8 * len(payload) / (2 * state.keys.numel())
    assert 2.0 < bits < 4.5


def test_the_outliers_are_kept_exactly():
    state = _state(seed=1)
    state.values[0, 0, 5, 2] = 80.0
    out = KVQuantLiteCodec(LAYOUT).decode(KVQuantLiteCodec(LAYOUT).encode(state))
    assert abs(float(out.values[0, 0, 5, 2]) - 80.0) < 0.1


def test_hostile_outlier_indices_and_shapes_are_refused():
    codec = KVQuantLiteCodec(LAYOUT)
    codec_id, meta, tensors = unpack(codec.encode(_state(tokens=32)), "kvq2")
    bad = dict(tensors, k_out_index=torch.tensor([10**8] * tensors["k_out_index"].numel(), dtype=torch.int32))
    with pytest.raises(PayloadError):
        codec.decode(pack(codec_id, meta, bad))
    with pytest.raises(PayloadError):
        codec.decode(pack(codec_id, {**meta, "shape": [2, 2, 32, 8]}, tensors))
    with pytest.raises(PayloadError):
        codec.decode(pack(codec_id, meta, dict(tensors, k_codes=pack_bits(torch.zeros(10, dtype=torch.uint8), 2))))
    with pytest.raises(PayloadError):
        codec.decode(pack(codec_id, meta, tensors), expect_tokens=31)
