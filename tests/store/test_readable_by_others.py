"""A producer's check of what other processes can read: its own copies do not count (a shared tier that lost
the blobs is seen), a shared tier that cannot answer is no reason to store again, and nothing is counted."""

from __future__ import annotations

from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from tests.store.conftest import HASHES, FailingTier, put_all


class SharedTier(FailingTier):
    kind = "shared"
    shared = True


def test_a_shared_tier_that_lost_the_blobs_is_seen_through_the_producers_own_copies(registry) -> None:
    shared = SharedTier()
    store = TieredStore([CpuTier(1 << 20), shared], registry, chunk_size=4, backoff_min_s=0.01, backoff_max_s=0.02)
    try:
        view = store.producer("space-a", "producer-m", "space-fp")
        put_all(store)
        store.flush()
        lookups = store.stats.value("lookups")
        assert view.readable_by_others(HASHES) == 6
        del shared.data[view.keys(HASHES)[2]]  # e.g. an eviction, or a restart without persistence
        assert view.contains(HASHES) == 6  # presence in any tier: the producer's CPU copy hides the loss
        assert view.readable_by_others(HASHES) == 2
        shared.data.clear()
        assert view.readable_by_others(HASHES) == 0
        shared.broken = True
        assert view.readable_by_others(HASHES) == 6  # cannot tell: never store again on a guess
        assert store.stats.value("lookups") == lookups + 1  # only the contains above counted
    finally:
        store.close()


def test_without_a_shared_tier_every_tier_counts(registry) -> None:
    with TieredStore([CpuTier(1 << 20)], registry, chunk_size=4) as store:
        put_all(store, 3)
        assert store.producer("space-a", "producer-m", "space-fp").readable_by_others(HASHES) == 3
