"""Bootstrap intervals: they hold the mean, narrow with more items, are reproducible, and pair items."""

from __future__ import annotations

import numpy as np
import pytest

from scd_store.bench.intervals import Interval, bootstrap_mean, bootstrap_paired


def test_an_interval_holds_the_mean_and_narrows_with_more_items():
    rng = np.random.default_rng(3)
    few, many = rng.uniform(0, 1, 20), rng.uniform(0, 1, 2000)
    small, large = bootstrap_mean(few), bootstrap_mean(many)
    assert small.low <= small.mean <= small.high and small.n == 20
    assert large.high - large.low < (small.high - small.low) / 5
    assert large.low < 0.5 < large.high  # the true mean of U(0, 1)
    assert bootstrap_mean(few) == small  # a fixed seed: the same report twice


def test_a_paired_difference_sees_what_two_unpaired_intervals_blur():
    rng = np.random.default_rng(5)
    base = rng.uniform(0, 1, 30)  # items differ a lot; each item's two measurements differ a little
    a, b = base + 0.05, base
    assert bootstrap_mean(a).low < bootstrap_mean(b).high  # the unpaired intervals overlap
    diff = bootstrap_paired(a, b)
    assert diff.low > 0 and diff.mean == pytest.approx(0.05)


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        bootstrap_mean([])
    with pytest.raises(ValueError):
        bootstrap_mean([1.0, float("nan")])
    with pytest.raises(ValueError):
        bootstrap_paired([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        Interval(0.5, 0.6, 0.7, 3)
    assert Interval(0.512, 0.44, 0.581, 20).text() == "51.2% [44.0, 58.1]"
