"""Every tier call under one gate: the tier's health (skip while in backoff) and the op timeout.

A failing call is a miss, a ``tier_errors`` count and, once per incident, a log line
(:class:`~scd_store.store.health.TierHealth`); the caller gets its default and carries on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from scd_store.store.health import TierHealth
from scd_store.store.stats import StoreStats
from scd_store.store.tiers.base import LocalTier, Tier

T = TypeVar("T")


class TierGuard:
    """Health gates and timeouts for a store's tiers; ``health[name]`` is each tier's state and
    ``timeouts[name]`` its own deadline per call (``op_timeout_s`` unless ``tier_timeouts`` says)."""

    def __init__(self, tiers: Sequence[Tier], stats: StoreStats, *, op_timeout_s: float,
                 backoff_min_s: float, backoff_max_s: float, tier_timeouts: Mapping[str, float] | None = None) -> None:
        self.stats = stats
        self.op_timeout_s = op_timeout_s
        self.timeouts = {t.name: float((tier_timeouts or {}).get(t.name, op_timeout_s)) for t in tiers}
        self.health = {t.name: TierHealth(t.name, backoff_min_s, backoff_max_s) for t in tiers}

    def deadline(self, tiers: Sequence[Tier]) -> float:
        """The longest a walk over ``tiers`` may take (each one's deadline, in turn)."""
        return sum(self.timeouts[t.name] for t in tiers)

    def failed(self, tier: Tier, exc: BaseException) -> None:
        """Count and record one failure of ``tier``."""
        self.stats.inc("tier_errors", tier=tier.name)
        self.health[tier.name].failed(exc)

    async def call(self, tier: Tier, op: str, fn: Callable[[], Awaitable[T]], default: T, *, success: Any = None,
                   health: bool = True) -> T:
        """Run one async tier operation; a failure or timeout returns ``default``, a success ``success``
        (when given) or the operation's result. With ``health=False`` (reports a reader makes on the side) a
        failure leaves the tier's health alone: a full report hash must not make a tier's blobs misses."""
        state = self.health[tier.name]
        if not state.should_try():
            return default
        t0 = time.perf_counter()
        try:
            result = await asyncio.wait_for(fn(), self.timeouts[tier.name])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if health:
                self.failed(tier, exc)
            return default
        state.succeeded()
        self.stats.observe(op, time.perf_counter() - t0, tier=tier.name)
        return success if success is not None else result

    def call_now(self, tier: LocalTier, op: str, fn: Callable[[], T]) -> T | None:
        """Run one synchronous operation of a local tier on the caller's thread; None on failure or backoff."""
        health = self.health[tier.name]
        if not health.should_try():
            return None
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:
            self.failed(tier, exc)
            return None
        health.succeeded()
        self.stats.observe(op, time.perf_counter() - t0, tier=tier.name)
        return result
