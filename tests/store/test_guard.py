"""The tier guard: a guarded call's default on failure, its ``success`` answer, and its flags as keywords."""

from __future__ import annotations

import asyncio

import pytest

from scd_store.store.guard import TierGuard
from scd_store.store.stats import StoreStats
from tests.store.conftest import FailingTier


def _guard(tier: FailingTier) -> TierGuard:
    return TierGuard([tier], StoreStats(), op_timeout_s=1.0, backoff_min_s=0.01, backoff_max_s=0.1)


def test_a_call_answers_its_result_its_success_or_its_default() -> None:
    tier = FailingTier()
    guard = _guard(tier)
    assert asyncio.run(guard.call(tier, "contains", lambda: tier.contains_many(["k"]), None)) == [False]
    assert asyncio.run(guard.call(tier, "put", lambda: tier.put_many([("k", b"v")]), False, success=True)) is True
    tier.broken = True
    assert asyncio.run(guard.call(tier, "get", lambda: tier.get_many(["k"]), None, health=False)) is None
    assert not guard.health[tier.name].down  # health=False: a failure leaves the tier's health alone
    assert asyncio.run(guard.call(tier, "get", lambda: tier.get_many(["k"]), None)) is None
    assert guard.health[tier.name].down and guard.stats.value("tier_errors", tier=tier.name) == 1


def test_the_flags_are_keyword_only() -> None:
    tier = FailingTier()
    with pytest.raises(TypeError):
        _guard(tier).call(tier, "put", lambda: tier.put_many([]), False, True)
