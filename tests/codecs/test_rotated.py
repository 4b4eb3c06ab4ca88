import math

import pytest
import torch

from scd_store.codecs import KVState, PayloadError, make_codec
from scd_store.codecs.rotated import levels, pack_bits, rotation, unpack_bits


def test_the_rotation_is_orthonormal_and_the_same_in_every_process():
    r = rotation(16)
    torch.testing.assert_close(r @ r.T, torch.eye(16), atol=1e-6, rtol=0)
    torch.testing.assert_close(rotation(16), r)
    with pytest.raises(ValueError, match="power-of-two"):
        rotation(48)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_bit_planes_round_trip_any_count(bits):
    codes = torch.randint(0, 1 << bits, (37,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == bits * 5
    torch.testing.assert_close(unpack_bits(packed, bits, 37), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_error_falls_with_bits_near_the_gaussian_quantiser_s(kv_state, bits, device):
    codec = make_codec(f"rot{bits}")
    payload = codec.encode(kv_state.to(device))
    out = codec.decode(payload, device=device).to("cpu")
    err = float((out.values - kv_state.values).pow(2).sum() / kv_state.values.pow(2).sum())
    gaussian_mse = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}[bits]  # Lloyd-Max, unit Gaussian
    assert err < 1.6 * gaussian_mse
    elements = kv_state.keys.numel() * 2
    vectors = elements // kv_state.head_dim
    assert len(payload) <= (elements * bits + vectors * 16) / 8 + 600  # bits per element + an fp16 norm + header


def test_a_payload_whose_norms_do_not_fit_its_shape_is_refused(kv_state):
    codec = make_codec("rot2")
    payload = codec.encode(kv_state)
    other = codec.encode(KVState(kv_state.keys[:, :, :8], kv_state.values[:, :, :8]))
    with pytest.raises(PayloadError):
        codec.decode(payload, expect_tokens=8)
    assert codec.decode(other).num_tokens == 8


def test_levels_are_symmetric_and_ascending():
    lv = levels(3)
    assert lv.numel() == 8 and bool((lv.diff() > 0).all()) and math.isclose(float(lv.sum()), 0.0, abs_tol=1e-6)


def test_a_head_dim_that_is_not_a_power_of_two_is_padded_and_cut_back():
    gen = torch.Generator().manual_seed(3)
    state = KVState(torch.randn(2, 1, 12, 48, generator=gen), torch.randn(2, 1, 12, 48, generator=gen))
    codec = make_codec("rot3")
    out = codec.decode(codec.encode(state))
    assert out.keys.shape == state.keys.shape
    assert float((out.keys - state.keys).pow(2).sum() / state.keys.pow(2).sum()) < 0.08
