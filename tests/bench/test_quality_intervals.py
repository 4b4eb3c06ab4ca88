import math

import torch

from scd_store.bench.metrics import ContinuationScore
from scd_store.bench.quality_intervals import method_intervals, paired_difference


def _scores(noise: float, windows: int = 12, seed: int = 0) -> tuple[ContinuationScore, ContinuationScore]:
    gen = torch.Generator().manual_seed(seed)
    oracle, method = ContinuationScore(), ContinuationScore()
    for _ in range(windows):
        logits = torch.randn(16, 40, generator=gen)
        targets = logits.argmax(-1)
        oracle.add(logits, logits, targets)
        method.add(logits + noise * torch.randn(16, 40, generator=gen), logits, targets)
    return oracle, method


def test_a_method_s_intervals_bracket_its_means_and_its_perplexity_rise():
    oracle, method = _scores(1.0)
    ci = method_intervals(method, oracle)
    assert ci["kl"]["low"] <= method.mean_kl <= ci["kl"]["high"] and ci["kl"]["n"] == 12
    assert ci["top1"]["low"] <= method.top1_rate <= ci["top1"]["high"] < 1.0
    assert math.isclose(ci["ppl_rel"]["mean"], method.ppl / oracle.ppl - 1, rel_tol=1e-3)
    assert ci["ppl_rel"]["low"] > 0  # noise on the argmax target's logits only makes it less likely


def test_paired_difference_separates_a_noisier_method_and_not_an_identical_one():
    oracle, small = _scores(0.3, seed=1)
    _, large = _scores(1.5, seed=1)
    diff = paired_difference(large, small)
    assert diff["kl"]["low"] > 0 and diff["top1"]["high"] < 0 and diff["ppl_ratio"]["low"] > 0
    same = paired_difference(small, small)
    assert same["kl"]["mean"] == 0 and same["top1"]["low"] == same["top1"]["high"] == 0
