"""Bootstrap intervals for per-item measurements (a window's agreement, a request's TTFT): the mean and
its percentile interval, and the mean of a paired difference (two routes on the same items) with its
interval. Items are resampled with replacement, ``resamples`` times, from a fixed seed, so a report is
reproducible."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 4000
LEVEL = 0.95


@dataclass(frozen=True, slots=True)
class Interval:
    """A mean over ``n`` items and its bootstrap interval at ``level``."""

    mean: float
    low: float
    high: float
    n: int
    level: float = LEVEL

    def __post_init__(self) -> None:
        if self.n < 1 or not 0 < self.level < 1 or not self.low <= self.mean <= self.high:
            raise ValueError(f"not an interval: {self}")

    def as_dict(self, digits: int = 4) -> dict[str, float | int]:
        return {"mean": round(self.mean, digits), "low": round(self.low, digits), "high": round(self.high, digits),
                "n": self.n, "level": self.level}

    def text(self, percent: bool = True) -> str:
        """``51.2% [44.0, 58.1]`` (or the plain numbers)."""
        if percent:
            return f"{self.mean:.1%} [{self.low * 100:.1f}, {self.high * 100:.1f}]"
        return f"{self.mean:.3g} [{self.low:.3g}, {self.high:.3g}]"


def bootstrap_mean(values: Sequence[float], *, resamples: int = RESAMPLES, level: float = LEVEL,
                   seed: int = 0) -> Interval:
    """The mean of ``values`` and its percentile bootstrap interval."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0 or not np.isfinite(x).all():
        raise ValueError("bootstrap_mean needs a non-empty list of finite numbers")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    mean = float(x.mean())
    return Interval(mean, min(float(low), mean), max(float(high), mean), int(x.size), level)


def bootstrap_paired(a: Sequence[float], b: Sequence[float], *, resamples: int = RESAMPLES, level: float = LEVEL,
                     seed: int = 0) -> Interval:
    """The mean of ``a[i] - b[i]`` (the same items measured two ways) and its bootstrap interval."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    return bootstrap_mean([x - y for x, y in zip(a, b, strict=True)], resamples=resamples, level=level, seed=seed)
