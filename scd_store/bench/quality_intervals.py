"""Bootstrap intervals of ``bench quality``'s measures over its windows: each method's KL, top-1 and
perplexity increase, and paired differences between two methods on the same windows."""

from __future__ import annotations

import math

from scd_store.bench.intervals import Interval, bootstrap_mean, bootstrap_paired
from scd_store.bench.metrics import ContinuationScore


def _ppl_rel(interval: Interval) -> dict:
    """A mean per-token NLL difference against the oracle as a perplexity ratio minus 1, with its interval."""
    return {"mean": round(math.expm1(interval.mean), 5), "low": round(math.expm1(interval.low), 5),
            "high": round(math.expm1(interval.high), 5), "n": interval.n, "level": interval.level}


def method_intervals(score: ContinuationScore, oracle: ContinuationScore) -> dict:
    """Intervals over windows of ``score``'s KL, top-1 and perplexity against ``oracle`` (the same windows)."""
    nll, kl, top1 = zip(*score.windows, strict=True)
    oracle_nll = [w[0] for w in oracle.windows]
    return {"kl": bootstrap_mean(kl).as_dict(5), "top1": bootstrap_mean(top1).as_dict(4),
            "ppl_rel": _ppl_rel(bootstrap_paired(nll, oracle_nll))}


def paired_difference(a: ContinuationScore, b: ContinuationScore) -> dict:
    """``a`` minus ``b`` on the same windows: KL, top-1 and the perplexity ratio ``ppl(a) / ppl(b) - 1``."""
    a_nll, a_kl, a_top1 = zip(*a.windows, strict=True)
    b_nll, b_kl, b_top1 = zip(*b.windows, strict=True)
    return {"kl": bootstrap_paired(a_kl, b_kl).as_dict(5), "top1": bootstrap_paired(a_top1, b_top1).as_dict(4),
            "ppl_ratio": _ppl_rel(bootstrap_paired(a_nll, b_nll))}
