import math

import torch

from scd_store.bench.entropy_audit import (
    coarsen,
    coded_bits,
    ecsq_allocate,
    ecsq_at_rate,
    ecsq_tables,
    entropy_bits,
    gaussian_rate,
)


def test_uniform_symbols_cost_their_width_and_a_skewed_table_less():
    gen = torch.Generator().manual_seed(0)
    uniform = torch.randint(0, 16, (20000, 3), generator=gen)
    bits = coded_bits(uniform[:10000], uniform[10000:], torch.full((3,), 16))
    assert torch.allclose(bits, torch.full((3,), 4.0), atol=0.02)
    skewed = (torch.rand(20000, 2, generator=gen) < 0.9).long()  # P(1) = 0.9: 0.469 bits
    bits = coded_bits(skewed[:10000], skewed[10000:], torch.full((2,), 2))
    assert torch.allclose(bits, torch.full((2,), 0.469), atol=0.02)
    assert torch.allclose(entropy_bits(skewed, torch.full((2,), 2)), torch.full((2,), 0.469), atol=0.01)


def test_a_symbol_never_seen_in_the_tables_still_costs_finite_bits():
    train = torch.zeros(1000, 1, dtype=torch.long)
    test = torch.ones(10, 1, dtype=torch.long)
    bits = coded_bits(train, test, torch.tensor([4]))
    assert torch.isfinite(bits).all() and bits.item() > 8  # rare: expensive, never infinite


def test_a_context_that_predicts_the_symbol_removes_its_cost():
    gen = torch.Generator().manual_seed(1)
    symbols = torch.randint(0, 8, (20000, 1), generator=gen)
    context = symbols.clone()  # the context is the symbol itself: nothing left to code
    plain = coded_bits(symbols[:10000], symbols[10000:], torch.tensor([8]))
    given = coded_bits(symbols[:10000], symbols[10000:], torch.tensor([8]), context[:10000], context[10000:], 8)
    assert plain.item() > 2.9 and given.item() < 0.01


def test_coarse_contexts_keep_the_top_bits_of_wide_codes_only():
    codes = torch.tensor([[255, 3, 1]], dtype=torch.uint8)
    assert coarsen(codes, torch.tensor([8, 2, 1])).tolist() == [[7, 3, 1]]


def test_entropy_coded_quantisers_trade_rate_for_distortion_on_a_gaussian():
    gen = torch.Generator().manual_seed(2)
    sigma = torch.tensor([1.0, 3.0])
    train = torch.randn(40000, 2, generator=gen) * sigma
    test = torch.randn(40000, 2, generator=gen) * sigma
    tables = ecsq_tables(train, test, sigma)
    # finer steps: more bits, less error; "not sent" costs nothing and leaves the variance
    assert tables.rate[:, 0].eq(0).all() and torch.allclose(tables.mse[:, 0], sigma**2, rtol=0.05)
    assert (tables.rate[:, 2:].diff(dim=1) <= 0.02).all() and (tables.mse[:, 2:].diff(dim=1) >= -1e-3).all()
    weights = torch.ones(2)
    target = float((sigma**2).sum()) * 0.1
    _, rate, distortion = ecsq_allocate(tables, weights, target)
    assert distortion <= target * 1.001
    # an entropy-coded scalar quantiser is within ~0.25 bit of the Gaussian bound at this rate, and above it
    bound = gaussian_rate(sigma**2, target) / 2
    assert bound - 0.01 <= rate <= bound + 0.35
    _, got, _ = ecsq_at_rate(tables, weights, rate)
    assert got <= rate + 1e-6


def test_reverse_water_filling_matches_the_closed_form():
    assert math.isclose(gaussian_rate(torch.tensor([4.0]), 1.0), 1.0, rel_tol=1e-6)  # 0.5 log2(4 / 1)
    # water level 1: the small component is not coded, the large one gets 0.5 log2(16)
    assert math.isclose(gaussian_rate(torch.tensor([16.0, 0.5]), 1.5), 2.0, rel_tol=1e-5)
    assert gaussian_rate(torch.tensor([1.0, 1.0]), 5.0) == 0.0
