"""The decode's products: centred folding, bf16 products on CPUs with AMX, decoding into given buffers."""

import pytest
import torch

from scd_store.codecs import PayloadError
from scd_store.codecs.registry import make_codec
from scd_store.codecs.scd import codec as codec_module
from scd_store.codecs.scd.codec import ScdCodec, cpu_has_bf16_products, matmul_dtype
from scd_store.codecs.scd.decoder import PairDecoder, centred_codes, code_centres
from tests.bundles import LAYOUT, correlated_state, tiny_space


def _pair(budget: float = 0.3, sinks: int = 2) -> tuple:
    space = tiny_space(budget, "products", sinks, "prod-fp")
    g, c = LAYOUT.groups, LAYOUT.width
    weight = torch.randn(g, c, c, generator=torch.Generator().manual_seed(1)) * 0.05
    bias = torch.randn(g, c, generator=torch.Generator().manual_seed(2))
    return space, PairDecoder("c", space.fingerprint, weight, bias)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_centred_fold_gives_the_same_features_as_the_plain_fold():
    space, decoder = _pair()
    codes = space.unpack(ScdCodec(space).encode(correlated_state(24, start=3, seed=4))).codes  # [T, G * C] uint8
    q = codes.view(codes.shape[0], LAYOUT.groups, LAYOUT.width).transpose(0, 1).double()  # [G, T, C]
    plain_m, plain_c = decoder.folded(space, "cpu", torch.float64)
    centred_m, centred_c = decoder.folded(space, "cpu", torch.float64, centred=True)
    signed = torch.empty(codes.t().shape, dtype=torch.float64)
    centred_codes(codes.t().contiguous(), code_centres(space).flatten().unsqueeze(1).to(torch.uint8), signed)
    s = signed.t().reshape(codes.shape[0], LAYOUT.groups, LAYOUT.width).transpose(0, 1)
    assert s.abs().max() <= 128 and torch.equal(s, s.round())  # small integers: exact in bf16
    assert float(s.abs().mean()) < float(q.abs().mean())  # centred around the quantisers' middles
    expected = torch.baddbmm(plain_c.unsqueeze(1), q, plain_m)
    torch.testing.assert_close(torch.baddbmm(centred_c.unsqueeze(1), s, centred_m), expected, rtol=1e-9, atol=1e-9)


def test_bf16_products_decode_close_to_fp32_products():
    space, decoder = _pair()
    state = correlated_state(40, start=0, seed=6)
    payload = ScdCodec(space).encode(state)
    exact = ScdCodec(space, decoder, matmul="float32").decode(payload)
    low = ScdCodec(space, decoder, matmul="bfloat16").decode(payload)
    assert torch.equal(low.keys[:, :, :2], exact.keys[:, :, :2])  # sinks are not products
    # bf16 rounding (~2^-9) is far below the quantisation error of the codes themselves
    quantised = ScdCodec(space, PairDecoder.identity(space, "i"), matmul="float32").decode(payload)
    assert 0 < rel(low.keys, exact.keys) < 0.01 and 0 < rel(low.values, exact.values) < 0.01
    assert rel(low.values, exact.values) < 0.2 * rel(quantised.values[:, :, 2:], state.values[:, :, 2:])


def test_bf16_products_decode_in_token_chunks_like_all_at_once(monkeypatch):
    space, decoder = _pair()
    payload = ScdCodec(space).encode(correlated_state(40, start=0, seed=8))
    whole = ScdCodec(space, decoder, matmul="bfloat16").decode(payload)
    monkeypatch.setattr(codec_module, "_CPU_STEP_TOKENS", 7)
    monkeypatch.setattr(codec_module, "_CPU_STEP_BYTES", 1)
    chunked = ScdCodec(space, decoder, matmul="bfloat16").decode(payload)
    torch.testing.assert_close(chunked.keys, whole.keys, rtol=0, atol=0)
    torch.testing.assert_close(chunked.values, whole.values, rtol=0, atol=0)


def test_matmul_choice_is_validated_and_auto_follows_the_hardware(monkeypatch):
    space, decoder = _pair()
    with pytest.raises(ValueError, match="matmul"):
        ScdCodec(space, decoder, matmul="int8")
    monkeypatch.delenv("SCD_STORE_DECODE_MATMUL", raising=False)
    expected = torch.bfloat16 if cpu_has_bf16_products() else torch.float32
    assert matmul_dtype("auto", "cpu") == expected
    assert matmul_dtype("float32", "cpu") == torch.float32
    monkeypatch.setenv("SCD_STORE_DECODE_MATMUL", "float32")
    assert matmul_dtype("auto", "cpu") == torch.float32
    assert ScdCodec(space, decoder).product_dtype("cpu") == torch.float32
    monkeypatch.setenv("SCD_STORE_DECODE_MATMUL", "fp8")
    with pytest.raises(ValueError, match="SCD_STORE_DECODE_MATMUL"):
        matmul_dtype("auto", "cpu")


@pytest.mark.parametrize("matmul", ["float32", "bfloat16"])
def test_decode_into_given_buffers_equals_a_fresh_decode(matmul):
    space, decoder = _pair()
    codec = ScdCodec(space, decoder, matmul=matmul)
    payload = codec.encode(correlated_state(30, start=5, seed=9))
    fresh = codec.decode(payload)
    # an engine's buffers: LMCache's [2, layers, tokens, heads * dim] chunk, viewed as [layers, heads, tokens, dim]
    chunk = torch.full((2, LAYOUT.num_layers, 30, LAYOUT.width), float("nan"))
    view = chunk.view(2, LAYOUT.num_layers, 30, LAYOUT.kv_heads, LAYOUT.head_dim).permute(0, 1, 3, 2, 4)
    out = codec.decode_into(payload, view[0], view[1])
    assert out.keys.data_ptr() == chunk[0].data_ptr() and out.start == 5 and not chunk.isnan().any()
    assert torch.equal(out.keys, fresh.keys) and torch.equal(out.values, fresh.values)


def test_the_default_decode_into_copies_for_codecs_without_their_own():
    state = correlated_state(10, start=2, seed=1)
    codec = make_codec("int8")
    keys, values = torch.empty_like(state.keys), torch.empty_like(state.values)
    out = codec.decode_into(codec.encode(state), keys, values)
    fresh = codec.decode(codec.encode(state))
    assert out.keys is keys and out.start == fresh.start
    assert torch.equal(keys, fresh.keys) and torch.equal(values, fresh.values)
    with pytest.raises(PayloadError, match="tokens"):
        codec.decode_into(codec.encode(state), keys[:, :, :9], values[:, :, :9])


def test_decode_into_buffers_of_another_token_count_or_shape_is_refused():
    space, decoder = _pair()
    codec = ScdCodec(space, decoder)
    payload = codec.encode(correlated_state(12, start=0, seed=3))
    shape = (LAYOUT.num_layers, LAYOUT.kv_heads, 12, LAYOUT.head_dim)
    short = (LAYOUT.num_layers, LAYOUT.kv_heads, 11, LAYOUT.head_dim)
    with pytest.raises(PayloadError, match="decodes to 12 tokens"):  # the payload disagrees with its header
        codec.decode_into(payload, torch.empty(short), torch.empty(short))
    with pytest.raises(ValueError, match="cannot take"):
        codec.decode_into(payload, torch.empty(shape[:3] + (4,)), torch.empty(shape[:3] + (4,)))
    with pytest.raises(ValueError, match="share"):
        codec.decode_into(payload, torch.empty(shape), torch.empty(shape, dtype=torch.float64))
