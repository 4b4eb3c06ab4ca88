import pytest
import torch

from scd_store.codecs.scd.quantizer import (
    DISTORTION,
    PackingPlan,
    allocate_bits,
    dequantize,
    pack_codes,
    packed_size,
    quantize,
    unpack_codes,
    unpack_codes_by_component,
    unpack_sorted,
)


@pytest.mark.parametrize("tokens", [1, 6, 13, 64, 257, 444])
def test_pack_round_trip_with_mixed_widths(tokens):
    bits = torch.tensor([8, 0, 3, 1, 5, 3, 0, 2, 7, 4, 6, 1, 1, 2])
    codes = torch.stack([torch.randint(0, 1 << int(b), (tokens,)) if b else torch.zeros(tokens, dtype=torch.long)
                         for b in bits], dim=1).to(torch.uint8)
    packed = pack_codes(codes, bits)
    # power-of-two parts, each padded to whole 8-byte words: at most 8 bytes per part over exact packing
    parts = sum(bin(int(b)).count("1") for b in bits.unique() if b > 0)
    assert packed.numel() == packed_size(tokens, bits) <= (tokens * int(bits.sum()) + 7) // 8 + 8 * parts
    assert torch.equal(unpack_codes(packed, tokens, bits), codes)
    by_component = unpack_codes_by_component(packed, tokens, bits)
    assert by_component.is_contiguous() and torch.equal(by_component, codes.t())
    # storage order: the plan's row of each component, and a zero row last
    plan = PackingPlan.of(bits)
    rows = unpack_sorted(packed, tokens, bits)
    carried = int((bits > 0).sum())
    # each width's region starts on an 8-byte row: at most 7 padding rows before it
    assert carried + 1 <= rows.shape[0] <= carried + 1 + 7 * len(plan.widths)
    assert rows.shape[1] == tokens and not rows[-1].any()
    assert torch.equal(rows[plan.rows(tokens)], codes.t())


def test_unpack_reads_a_payload_at_any_offset_and_refuses_wrong_sizes():
    bits = torch.tensor([3, 5, 1])
    codes = torch.stack([torch.randint(0, 1 << int(b), (40,)) for b in bits], dim=1).to(torch.uint8)
    packed = pack_codes(codes, bits)
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), packed])[3:]  # storage offset 3: not word aligned
    assert torch.equal(unpack_codes(shifted, 40, bits), codes)
    with pytest.raises(ValueError, match="expected"):
        unpack_codes(packed[:-1], 40, bits)


def test_gaussian_distortion_matches_the_table():
    torch.manual_seed(0)
    z = torch.randn(200_000, 4) * torch.tensor([1.0, 2.0, 0.5, 3.0])
    sigma = torch.tensor([1.0, 2.0, 0.5, 3.0])
    for b in (1, 2, 4, 8):
        bits = torch.full((4,), b)
        zhat = dequantize(quantize(z, sigma, bits), sigma, bits)
        mse = ((zhat - z) ** 2).mean(0) / sigma**2
        assert torch.allclose(mse, torch.full((4,), DISTORTION[b]), rtol=0.15), (b, mse)


def test_allocation_spends_the_budget_and_favours_large_weighted_variance():
    variances = torch.tensor([100.0, 10.0, 1.0, 0.01])
    bits = allocate_bits(variances, torch.ones(4), total_bits=12)
    assert int(bits.sum()) == 12
    assert bits[0] >= bits[1] >= bits[2] >= bits[3]
    weighted = allocate_bits(variances, torch.tensor([1.0, 1.0, 1.0, 1e6]), total_bits=12)
    assert weighted[3] > bits[3]


def test_zero_bit_components_decode_to_zero():
    bits = torch.tensor([0, 4])
    zhat = dequantize(quantize(torch.randn(5, 2), torch.ones(2), bits), torch.ones(2), bits)
    assert torch.all(zhat[:, 0] == 0) and torch.any(zhat[:, 1] != 0)
