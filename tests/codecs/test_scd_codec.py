import json

import pytest
import torch

from scd_store.codecs import KVState, PayloadError
from scd_store.codecs.scd.bundle import BundleError, load_pair, load_space, save_pair, save_space
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.layout import KVLayout
from scd_store.codecs.scd.space import CodeSpace
from tests.bundles import LAYOUT, correlated_state, tiny_space


def fitted_space(budget: float, sinks: int = 2) -> CodeSpace:
    return tiny_space(budget, "test", sinks, "prod-fp")


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_identity_decoder_reconstructs_the_producer_kv_at_high_budget(device):
    space = fitted_space(budget=0.5)
    codec = ScdCodec(space, PairDecoder.identity(space, "c"))
    state = correlated_state(30, start=0, seed=7)
    out = codec.decode(codec.encode(state.to(device)), device=device).to("cpu")
    assert out.keys.shape == state.keys.shape and out.start == 0
    assert torch.equal(out.keys[:, :, :2], state.keys[:, :, :2].half().float())  # sinks sent raw
    assert rel(out.keys, state.keys) < 0.05 and rel(out.values, state.values) < 0.05


def test_error_falls_with_budget_and_payload_grows():
    state = correlated_state(40, start=8, seed=3)
    errors, sizes = [], []
    for budget in (0.05, 0.15, 0.4):
        space = fitted_space(budget)
        payload = ScdCodec(space).encode(state)
        out = ScdCodec(space, PairDecoder.identity(space, "c")).decode(payload)
        errors.append(rel(out.values, state.values))
        sizes.append(len(payload))
    assert errors[0] > errors[1] > errors[2] and sizes[0] < sizes[1] < sizes[2]


def test_device_decode_equals_cpu_decode(device):
    space = fitted_space(budget=0.3)
    codec = ScdCodec(space, PairDecoder.identity(space, "c", mean_shift=torch.randn(LAYOUT.groups, LAYOUT.width)))
    payload = codec.encode(correlated_state(50, start=3, seed=5))
    # encoding on the device gives the same payload layout (codes may differ at quantiser boundaries)
    assert len(codec.encode(correlated_state(50, start=3, seed=5).to(device))) == len(payload)
    on_device, on_cpu = codec.decode(payload, device=device), codec.decode(payload)
    assert on_device.keys.device.type == torch.device(device).type
    torch.testing.assert_close(on_device.keys.cpu(), on_cpu.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(on_device.values.cpu(), on_cpu.values, atol=1e-4, rtol=1e-4)


def test_decoder_maps_are_applied():
    space = fitted_space(budget=0.5, sinks=0)
    shift = torch.zeros(LAYOUT.groups, LAYOUT.width)
    shift[1] = 5.0  # values of layer 0
    codec = ScdCodec(space, PairDecoder.identity(space, "c", mean_shift=shift), matmul="float32")
    state = correlated_state(10, seed=1)
    out = codec.decode(codec.encode(state))
    plain = ScdCodec(space, PairDecoder.identity(space, "c"), matmul="float32").decode(codec.encode(state))
    torch.testing.assert_close(out.values[0] - plain.values[0], torch.full_like(out.values[0], 5.0), atol=1e-4,
                               rtol=0)
    torch.testing.assert_close(out.keys, plain.keys)


def test_payload_of_another_space_or_corrupted_is_refused():
    space_a, space_b = fitted_space(0.2), fitted_space(0.3)
    payload = ScdCodec(space_a).encode(correlated_state(12))
    with pytest.raises(PayloadError, match="code space"):
        ScdCodec(space_b, PairDecoder.identity(space_b, "c")).decode(payload)
    with pytest.raises(PayloadError):
        ScdCodec(space_a, PairDecoder.identity(space_a, "c")).decode(payload[:-3])


def test_decoder_of_another_space_is_refused():
    space_a, space_b = fitted_space(0.2), fitted_space(0.3)
    with pytest.raises(ValueError, match="another code space"):
        ScdCodec(space_a, PairDecoder.identity(space_b, "c"))


def test_bundle_round_trip_and_checks(tmp_path):
    space = fitted_space(0.25)
    decoder = PairDecoder.identity(space, "cons", mean_shift=torch.randn(LAYOUT.groups, LAYOUT.width))
    decoder.consumer_fingerprint = "cons-fp"
    save_space(tmp_path, space)
    save_pair(tmp_path, decoder)
    loaded = load_space(tmp_path, producer_fingerprint="prod-fp")
    assert loaded.fingerprint == space.fingerprint and torch.equal(loaded.bits, space.bits)
    pair = load_pair(tmp_path, "cons", loaded, consumer_fingerprint="cons-fp")
    assert torch.equal(pair.bias, decoder.bias)
    with pytest.raises(BundleError, match="producer"):
        load_space(tmp_path, producer_fingerprint="other")
    with pytest.raises(BundleError, match="consumer weights"):
        load_pair(tmp_path, "cons", loaded, consumer_fingerprint="other")
    manifest = json.loads((tmp_path / "space.json").read_text())
    manifest["format_version"] = 99
    (tmp_path / "space.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="newer"):
        load_space(tmp_path)


def test_folded_decode_equals_the_unfolded_maths():
    from scd_store.codecs.scd.layout import from_features

    space = fitted_space(budget=0.2, sinks=0)
    weight = torch.randn(LAYOUT.groups, LAYOUT.width, LAYOUT.width) * 0.05
    bias = torch.randn(LAYOUT.groups, LAYOUT.width)
    decoder = PairDecoder("c", space.fingerprint, weight, bias)
    state = correlated_state(20, start=5, seed=2)
    payload = ScdCodec(space).encode(state)
    zhat = space.reconstruct(space.unpack(payload).codes)  # [T, G, C]
    x = torch.einsum("tgc,gdc->tgd", zhat, space.basis) + space.mean
    y = x + torch.einsum("tgc,gcd->tgd", x, weight) + bias
    expected = from_features(y, LAYOUT, start=5)
    out = ScdCodec(space, decoder, matmul="float32").decode(payload)
    torch.testing.assert_close(out.keys, expected.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.values, expected.values, atol=1e-4, rtol=1e-4)


def test_reuse_space_fingerprint_is_stable():
    # stored codes are bound to the space fingerprint: a code change must not silently re-key spaces
    layout = KVLayout(2, 2, 4, 1e4)
    mean = torch.arange(32, dtype=torch.float32).reshape(4, 8) / 8
    basis = torch.eye(8).repeat(4, 1, 1)
    sigma = torch.linspace(2.0, 0.5, 8).repeat(4, 1)
    bits = torch.tensor([6, 5, 4, 4, 3, 2, 0, 0]).repeat(4, 1)
    space = CodeSpace("golden", layout, mean, basis, sigma, bits, sink_tokens=4)
    assert space.fingerprint == "1409d4060b2660c45e41d27c19b45317"


def test_encode_refuses_kv_it_cannot_code_with_a_clear_error():
    space = fitted_space(budget=0.3)
    codec = ScdCodec(space)
    good = correlated_state(8)
    with pytest.raises(ValueError, match="calibrated for"):
        codec.encode(KVState(good.keys[:1].contiguous(), good.values[:1].contiguous()))
    bad = good.keys.clone()
    bad[0, 0, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        codec.encode(KVState(bad, good.values))


def test_streamed_cpu_decode_equals_decoding_all_layers_at_once(monkeypatch):
    import scd_store.codecs.scd.codec as codec_module

    space = fitted_space(budget=0.3)
    weight = torch.randn(LAYOUT.groups, LAYOUT.width, LAYOUT.width) * 0.05
    codec = ScdCodec(space, PairDecoder("c", space.fingerprint, weight, torch.randn(LAYOUT.groups, LAYOUT.width)))
    payload = codec.encode(correlated_state(33, seed=4))
    monkeypatch.setattr(codec_module, "_CPU_STEP_BYTES", 1 << 40)  # every layer and token in one step
    monkeypatch.setattr(codec_module, "_CPU_STEP_TOKENS", 1 << 20)
    assert codec._tile(29, "cpu") == (LAYOUT.num_layers, 29)
    at_once = codec.decode(payload)
    monkeypatch.setattr(codec_module, "_CPU_STEP_BYTES", 1)  # one layer per step, all tokens
    assert codec._tile(29, "cpu") == (1, 29)
    by_layer = codec.decode(payload)
    torch.testing.assert_close(by_layer.keys, at_once.keys, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(by_layer.values, at_once.values, atol=1e-6, rtol=1e-6)
    monkeypatch.setattr(codec_module, "_CPU_STEP_TOKENS", 7)  # and in chunks of 7 tokens (the last one shorter)
    assert codec._tile(29, "cpu") == (1, 7)
    chunked = codec.decode(payload)
    # shorter matmuls block their sums differently: equal to fp32 rounding of the 32-term sums
    torch.testing.assert_close(chunked.keys, at_once.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked.values, at_once.values, atol=1e-5, rtol=1e-5)


def test_payload_packed_another_way_is_refused():
    from scd_store.codecs.tensor_pack import pack, unpack

    space = fitted_space(budget=0.3)
    payload = ScdCodec(space).encode(correlated_state(12))
    codec_id, meta, tensors = unpack(payload)
    for packing in (None, "fields-1"):
        meta = {k: v for k, v in meta.items() if k != "packing"} | ({"packing": packing} if packing else {})
        with pytest.raises(PayloadError, match="packed as"):
            space.unpack(pack(codec_id, meta, tensors))


def test_fisher_weights_move_bits_to_sensitive_groups():
    feats = torch.cat([torch.randn(64, LAYOUT.groups, LAYOUT.width) for _ in range(2)]).transpose(0, 1).double()
    mean = feats.mean(1)
    cov = torch.einsum("gtc,gtd->gcd", feats - mean[:, None], feats - mean[:, None]) / feats.shape[1]
    plain = CodeSpace.from_statistics("plain", LAYOUT, mean, cov, 0.25)
    fisher = torch.eye(LAYOUT.width, dtype=torch.float64).repeat(LAYOUT.groups, 1, 1)
    fisher[1] *= 100.0  # layer 0's values matter 100x more
    weighted = CodeSpace.from_statistics("fisher", LAYOUT, mean, cov, 0.25, sensitivity=fisher)
    assert int(weighted.bits.sum()) == int(plain.bits.sum())
    assert weighted.bits[1].sum() > plain.bits[1].sum()
    assert all(weighted.bits[g].sum() <= plain.bits[g].sum() for g in range(LAYOUT.groups) if g != 1)
    with pytest.raises(ValueError, match="sensitivity"):
        CodeSpace.from_statistics("bad", LAYOUT, mean, cov, 0.25, sensitivity=fisher[:, :4, :4])


def test_a_space_without_bits_decodes_to_the_mean():
    space = fitted_space(budget=0.3)
    no_bits = torch.zeros_like(space.bits)
    empty = CodeSpace("empty", LAYOUT, space.mean, space.basis, space.sigma, no_bits, sink_tokens=0)
    codec = ScdCodec(empty, PairDecoder.identity(empty, "c"), matmul="float32")
    out = codec.decode(codec.encode(correlated_state(9)))
    assert out.values.shape == (LAYOUT.num_layers, LAYOUT.kv_heads, 9, LAYOUT.head_dim)
    expected = space.mean.view(LAYOUT.num_layers, 2, LAYOUT.kv_heads, LAYOUT.head_dim)[:, 1]
    torch.testing.assert_close(out.values, expected.unsqueeze(2).expand_as(out.values))
