import pytest
import torch

from scd_store.codecs import PayloadError
from scd_store.codecs.scd.bundle import BundleError, load_space, save_space
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.ecsq import EcsqQuantiser, fit
from scd_store.codecs.scd.layout import from_features, to_features
from scd_store.codecs.tensor_pack import pack, unpack
from tests.bundles import LAYOUT, correlated_state, tiny_ecsq_space, tiny_space


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_fitted_quantisers_meet_the_rate_budget_and_error_falls_with_it():
    gen = torch.Generator().manual_seed(0)
    sigma = torch.tensor([4.0, 2.0, 1.0, 0.5, 0.1])
    z = torch.randn(6000, 5, generator=gen) * sigma
    held_out = torch.randn(6000, 5, generator=gen) * sigma
    errors = []
    for budget in (0.5, 1.5, 3.0):
        q = fit(z, sigma, torch.ones(5), budget)
        assert q.mean_rate() <= budget + 0.02
        errors.append(float((held_out - q.dequantize(q.quantize(held_out))).pow(2).sum()))
        assert bool((q.widths[sigma < sigma.max()] <= q.widths[0]).all())  # the widest component gets the most
    assert errors[0] > errors[1] > errors[2]


def test_both_payload_formats_decode_to_the_same_kv_and_range_coding_is_smaller():
    state = correlated_state(60, start=0, seed=11)
    ranged = tiny_ecsq_space(1.5, "ans-1")
    planes = ranged.with_packing("planes-2")
    assert planes.fingerprint == ranged.fingerprint  # one space, two formats
    a = ScdCodec(ranged, PairDecoder.identity(ranged, "c"))
    b = ScdCodec(planes, PairDecoder.identity(planes, "c"))
    pa, pb = a.encode(state), b.encode(state)
    assert len(pa) < len(pb)
    out_a, out_b = a.decode(pa), a.decode(pb)  # either space object reads both formats
    torch.testing.assert_close(out_a.keys, out_b.keys)
    torch.testing.assert_close(b.decode(pa).values, out_b.values)
    assert rel(out_a.values, state.values) < 0.7


def test_the_folded_decode_is_the_mid_tread_reconstruction(device):
    space = tiny_ecsq_space(2.5, "planes-2")  # the fold is the format's business of neither: planes need no coder
    state = correlated_state(40, start=5, seed=2)  # past the sinks: every token coded
    codec = ScdCodec(space, PairDecoder.identity(space, "c"), matmul="float32")  # exact products: the fold's maths
    payload = codec.encode(state)
    codes = space.unpack(payload)
    features = torch.bmm(space.reconstruct(codes.codes).transpose(0, 1), space.basis.transpose(1, 2)).transpose(0, 1)
    expected = from_features(features + space.mean, LAYOUT, 5)
    out = codec.decode(payload, device=device).to("cpu")
    torch.testing.assert_close(out.keys, expected.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.values, expected.values, atol=1e-4, rtol=1e-4)
    # bf16 products (the default on CPUs with AMX or AVX512-BF16): bf16 rounding, far below the codes' own error
    rounded = ScdCodec(space, PairDecoder.identity(space, "c"), matmul="bfloat16").decode(payload, device=device)
    assert rel(rounded.keys.cpu(), expected.keys) < 0.01 and rel(rounded.values.cpu(), expected.values) < 0.01
    assert rel(expected.keys, state.keys) > 10 * rel(rounded.keys.cpu(), expected.keys)
    keys, values = torch.empty_like(out.keys), torch.empty_like(out.values)
    codec.decode_into(payload, keys, values)
    torch.testing.assert_close(keys, out.keys.cpu(), atol=1e-5, rtol=1e-5)


def test_the_quantiser_error_is_what_the_space_reconstructs():
    space = tiny_ecsq_space(3.0)
    state = correlated_state(40, start=2, seed=4)
    z = space.project(to_features(state, LAYOUT)).reshape(40, -1)
    zhat = space.reconstruct(space.ecsq.quantize(z)).reshape(40, -1)
    sent = space.ecsq.sent
    step = space.ecsq.steps[sent]
    inside = (z[:, sent] - zhat[:, sent]).abs() <= step / 2 + 1e-5
    assert float(inside.float().mean()) > 0.99  # clamped past the container only in the far tails


@pytest.mark.parametrize("damage", ["truncated", "appended", "uint8", "empty", "flipped", "no digest"])
def test_damaged_range_coded_words_are_refused(damage):
    space = tiny_ecsq_space(2.0)
    codec = ScdCodec(space, PairDecoder.identity(space, "c"))
    codec_id, meta, tensors = unpack(codec.encode(correlated_state(30, seed=1)), "scd")
    words = tensors["words"]
    flipped = words.clone()
    flipped[words.numel() // 2] ^= 0x10  # still a well-formed stream: it decodes, to other codes
    tensors["words"] = {"truncated": words[: words.numel() // 2], "appended": torch.cat([words, words[:3]]),
                        "uint8": words.view(torch.uint8), "empty": words[:0], "flipped": flipped,
                        "no digest": words}[damage]
    if damage == "no digest":
        del meta["codes_digest"]
    with pytest.raises(PayloadError):
        codec.decode(pack(codec_id, meta, tensors))


def test_a_fixed_rate_space_refuses_a_range_coded_payload():
    ecsq = tiny_ecsq_space(2.0)
    fixed = tiny_space(0.4, "tiny-ecsq", 2, "producer-fp")
    _, meta, tensors = unpack(ScdCodec(ecsq).encode(correlated_state(20, seed=3)), "scd")
    meta["space"] = fixed.fingerprint
    with pytest.raises(PayloadError, match="packed as"):
        fixed.unpack(pack("scd", meta, tensors))


def test_an_ecsq_bundle_round_trips_and_a_tampered_table_is_refused(tmp_path):
    space = tiny_ecsq_space(2.0)
    save_space(tmp_path, space)
    loaded = load_space(tmp_path)
    assert loaded.fingerprint == space.fingerprint and loaded.packing == "ans-1"
    assert torch.equal(loaded.ecsq.widths, space.ecsq.widths)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "space.safetensors"))
    tensors["ecsq_probabilities"] = tensors["ecsq_probabilities"].flip(0)  # another table, same size
    save_file(tensors, str(tmp_path / "space.safetensors"))
    with pytest.raises(BundleError, match="fingerprint"):
        load_space(tmp_path)


def test_quantiser_tables_are_checked():
    with pytest.raises(ValueError, match="probabilities"):
        EcsqQuantiser(torch.tensor([1.0, 0.0]), torch.tensor([2, 0]), torch.tensor([0.5, 0.5, 0.0, -1.0]))
    with pytest.raises(ValueError, match="widths need"):
        EcsqQuantiser(torch.tensor([1.0, 0.0]), torch.tensor([2, 0]), torch.ones(3))
    with pytest.raises(ValueError, match="steps"):
        EcsqQuantiser(torch.tensor([0.0, 0.0]), torch.tensor([2, 0]), torch.ones(4))
    with pytest.raises(ValueError, match="widths must be"):
        EcsqQuantiser(torch.tensor([1.0]), torch.tensor([1]), torch.ones(2))
    with pytest.raises(ValueError, match="flat tensor"):  # a hostile bundle's dtypes are refused, never coerced
        EcsqQuantiser(torch.tensor([1.0]), torch.tensor([2.9]), torch.ones(4))
    with pytest.raises(ValueError, match="flat float32 tensor"):
        EcsqQuantiser(torch.tensor([1.0], dtype=torch.float64), torch.tensor([2]), torch.ones(4))
    with pytest.raises(ValueError, match="flat float32 tensor"):
        EcsqQuantiser(torch.tensor([[1.0]]), torch.tensor([2]), torch.ones(4))


def test_a_stream_too_short_for_its_token_count_is_refused_before_decoding():
    space = tiny_ecsq_space(2.0)
    words = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cannot hold"):
        space.coder.decode_codes(words, 10_000, "0" * 16)
    assert space.coder.least_bits(100) > 0


def test_a_fixed_rate_space_with_code_tables_range_codes_the_same_codes():
    fixed = tiny_space(0.2, "tiny-tables", 2, "producer-fp")
    feats = torch.cat([to_features(correlated_state(64, seed=s), LAYOUT) for s in range(8)])
    ranged = fixed.with_tables(fixed.project(feats).reshape(feats.shape[0], -1))
    assert ranged.fingerprint != fixed.fingerprint and ranged.packing == "ans-1"
    assert ranged.payload_ratio() < fixed.payload_ratio()  # the tables' entropy is below the widths
    state = correlated_state(50, start=0, seed=21)
    identity = PairDecoder.identity(ranged, "c")
    payload = ScdCodec(ranged, identity).encode(state)
    planes = ScdCodec(ranged.with_packing("planes-2"), identity).encode(state)
    assert len(payload) < len(planes)
    a, b = ScdCodec(ranged, identity).decode(payload), ScdCodec(ranged, identity).decode(planes)
    torch.testing.assert_close(a.keys, b.keys)
    fixed_out = ScdCodec(fixed, PairDecoder.identity(fixed, "c")).decode(ScdCodec(fixed).encode(state))
    torch.testing.assert_close(a.values, fixed_out.values)  # the same quantiser: the same KV


def test_a_bundle_keeps_a_fixed_rate_space_s_code_tables(tmp_path):
    fixed = tiny_space(0.2, "tiny-tables", 2, "producer-fp")
    feats = torch.cat([to_features(correlated_state(64, seed=s), LAYOUT) for s in range(4)])
    ranged = fixed.with_tables(fixed.project(feats).reshape(feats.shape[0], -1))
    save_space(tmp_path, ranged)
    loaded = load_space(tmp_path)
    assert loaded.fingerprint == ranged.fingerprint and loaded.tables is not None and loaded.packing == "ans-1"
