import pytest
import torch

from scd_store.codecs import CODEC_NAMES, KVState, PayloadError, make_codec
from scd_store.codecs.group_quant import dequantize, quantize


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(("name", "max_err"),
                         [("raw", 1e-3), ("raw-bf16", 5e-3), ("int8", 1e-2), ("int4", 0.15), ("int2", 0.6)])
def test_round_trip_error_is_bounded(kv_state, name, max_err, device):
    codec = make_codec(name)
    out = codec.decode(codec.encode(kv_state.to(device)), device=device).to("cpu")
    assert out.keys.shape == kv_state.keys.shape and out.keys.dtype == torch.float32
    assert rel_err(out.keys, kv_state.keys) < max_err
    assert rel_err(out.values, kv_state.values) < max_err


@pytest.mark.parametrize("name", ["raw", "int8", "int4", "int2"])
def test_tensor_payload_decodes_like_bytes(kv_state, name, device):
    codec = make_codec(name)
    payload = codec.encode(kv_state)
    from_tensor = codec.decode(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device), device=device)
    torch.testing.assert_close(from_tensor.keys, codec.decode(payload, device=device).keys)


def test_payload_sizes_follow_bit_width(kv_state):
    sizes = {name: len(make_codec(name).encode(kv_state)) for name in CODEC_NAMES}
    assert sizes["int2"] < sizes["int4"] < sizes["int8"] < sizes["raw"]
    assert sizes["raw"] >= kv_state.fp16_bytes()


def test_kivi_groups_keys_per_channel_and_values_per_token():
    # A key channel with a huge constant offset must not hurt the other channels (per-channel keys);
    # a token with huge values must not hurt other tokens (per-token values).
    keys = torch.randn(1, 1, 64, 8)
    keys[..., 0] += 1000.0
    values = torch.randn(1, 1, 64, 8)
    values[:, :, 5] *= 1000.0
    state = KVState(keys, values)
    codec = make_codec("int4")
    out = codec.decode(codec.encode(state))
    assert rel_err(out.keys[..., 1:], keys[..., 1:]) < 0.15
    others = torch.ones(64, dtype=torch.bool)
    others[5] = False
    assert rel_err(out.values[:, :, others], values[:, :, others]) < 0.15


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("length", [1, 31, 32, 45])
def test_group_quant_handles_ragged_lengths(bits, length):
    x = torch.randn(2, 3, length)
    q = quantize(x, axis=2, group=32, bits=bits)
    y = dequantize(q, axis=2, length=length, bits=bits, ndim=3)
    assert y.shape == x.shape
    assert float((y - x).abs().max()) <= float((x.amax() - x.amin()) / ((1 << bits) - 1))


def test_decoding_another_codecs_payload_is_an_error(kv_state):
    with pytest.raises(PayloadError):
        make_codec("int4").decode(make_codec("int8").encode(kv_state))


def test_unknown_codec_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown codec"):
        make_codec("zstd")


def test_kv_state_validates_shapes():
    with pytest.raises(ValueError, match="differ in shape"):
        KVState(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 3, 4))
    with pytest.raises(ValueError, match="layers, kv_heads"):
        KVState(torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="hidden state"):
        KVState(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), {0: torch.zeros(3, 8)})


def test_two_bit_codes_pack_four_to_a_byte_and_round_trip_exactly():
    x = torch.arange(64, dtype=torch.float32).reshape(1, 64) % 4  # already on the 4-level grid
    q = quantize(x, axis=1, group=32, bits=2)
    assert q.codes.shape == (1, 2, 8)  # 2 groups of 32 codes, 4 per byte
    torch.testing.assert_close(dequantize(q, axis=1, length=64, bits=2, ndim=2), x)
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize(x, axis=1, group=30, bits=2)
