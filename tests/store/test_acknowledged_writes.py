"""Every acknowledged write is stored or counted: batches cut off at stop, values over a tier's bound, a
failed top tier."""

from __future__ import annotations

import asyncio

from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from tests.store.conftest import FailingTier, put_all


class StuckTier(FailingTier):
    """A lower tier whose puts never finish (a hung connection): the write-behind is cut off mid-write."""

    kind = "stuck"

    async def put(self, key, value):
        await asyncio.sleep(3600)


class BoundedTier(FailingTier):
    """A remote-like tier that takes values up to 55 bytes (as Redis's max_value_bytes)."""

    kind = "bounded"
    max_value_bytes = 55


def test_batches_in_flight_when_the_write_behind_stops_are_counted_lost(registry) -> None:
    stuck = StuckTier()
    store = TieredStore([CpuTier(1 << 20), stuck], registry, chunk_size=4, op_timeout_s=60.0, put_timeout_s=5.0)
    assert len(put_all(store)) == 6  # acknowledged: the top tier holds them
    unwritten = store.close(timeout=0.3)
    assert unwritten == {"stuck": 6}  # taken off the queue by the writer, never written
    assert store.stats.value("lost_writes", tier="stuck") == 6


def test_values_over_a_tiers_bound_are_never_reported_written(registry) -> None:
    bounded = BoundedTier()
    store = TieredStore([CpuTier(1 << 20), bounded], registry, chunk_size=4)
    try:
        assert len(put_all(store)) == 6  # the top tier holds them
        store.flush()
        assert bounded.data == {}  # every blob (payload 50-55 bytes + header) is over the tier's 55
        assert store.stats.value("oversized_writes", tier="bounded") == 6
        assert store.stats.value("bytes_written", tier="bounded") == 0
        assert store.stats.value("dropped_writes", tier="bounded") == 0  # not owed: never re-synced
    finally:
        store.close()


def test_a_value_over_the_top_tiers_bound_is_not_acknowledged(registry) -> None:
    store = TieredStore([CpuTier(100)], registry, chunk_size=4)  # every blob is larger than the whole tier
    try:
        assert put_all(store) == []
        assert store.stats.value("oversized_writes", tier="cpu") == 6 and store.stats.value("puts") == 0
    finally:
        store.close()


def test_a_failed_remote_top_tier_is_not_acknowledged(registry) -> None:
    top = FailingTier()
    top.broken = True
    store = TieredStore([top], registry, chunk_size=4)
    try:
        assert put_all(store) == []
        assert store.stats.value("lost_writes", tier="flaky") == 6 and store.stats.value("puts") == 0
        top.broken = False
        store.health["flaky"].succeeded()
        assert len(put_all(store)) == 6 and len(top.data) == 6
    finally:
        store.close()
