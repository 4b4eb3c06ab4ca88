import math

import torch

from scd_store.bench.metrics import ContinuationScore


def test_identical_logits_score_zero_kl_and_full_agreement():
    logits = torch.randn(10, 50)
    targets = torch.randint(0, 50, (10,))
    score = ContinuationScore()
    score.add(logits, logits, targets)
    assert abs(score.mean_kl) < 1e-6 and score.top1_rate == 1.0
    expected_nll = -torch.log_softmax(logits, -1)[torch.arange(10), targets].mean()
    assert math.isclose(score.ppl, math.exp(float(expected_nll)), rel_tol=1e-5)


def test_different_logits_score_positive_kl():
    oracle = torch.randn(8, 20)
    other = oracle + torch.randn(8, 20)
    score = ContinuationScore()
    score.add(other, oracle, torch.zeros(8, dtype=torch.long))
    assert score.mean_kl > 0.01 and score.tokens == 8


def test_each_window_keeps_its_own_means_beside_the_running_sums():
    oracle = torch.randn(2, 6, 30)
    score = ContinuationScore()
    score.add(oracle[0], oracle[0], torch.zeros(6, dtype=torch.long))
    score.add(oracle[1] + 3 * torch.randn(6, 30), oracle[1], torch.zeros(6, dtype=torch.long))
    (nll0, kl0, top0), (nll1, kl1, top1) = score.windows
    assert abs(kl0) < 1e-6 and top0 == 1.0 and kl1 > 0.1
    assert math.isclose((kl0 + kl1) / 2, score.mean_kl, rel_tol=1e-6)
    assert math.isclose(math.exp((nll0 + nll1) / 2), score.ppl, rel_tol=1e-6)
