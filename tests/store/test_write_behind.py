"""The write-behind and tier health: failing and stalling lower tiers."""

from __future__ import annotations

import time

from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from tests.conftest import skip_where_the_store_cannot_sign
from tests.store.conftest import HASHES, FailingTier, SlowTier, put_all


def test_failing_tier_is_a_miss_logged_once_and_recovers(registry, caplog) -> None:
    flaky = FailingTier()
    store = TieredStore([CpuTier(1 << 20), flaky], registry, chunk_size=4, backoff_min_s=0.01, backoff_max_s=0.02)
    try:
        consumer = store.consumer("pair-a", "consumer-m", "space-fp")
        keys = put_all(store)
        store.flush()
        assert len(flaky.data) == 6
        for key in keys:
            store.tiers[0].delete_now(key)
        flaky.broken = True
        with caplog.at_level("WARNING", logger="scd_store.store"):
            for _ in range(5):
                assert consumer.contains(HASHES) == 0
                assert consumer.get(HASHES) == []
        assert store.stats.value("tier_errors", tier="flaky") >= 1
        assert sum("failed" in r.message for r in caplog.records) == 1
        flaky.broken = False
        deadline = time.monotonic() + 5
        while consumer.contains(HASHES) != 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert consumer.contains(HASHES) == 6
        assert not store.health["flaky"].down and store.health["flaky"].incidents == 1
    finally:
        store.close()


def test_back_pressure_blocks_then_drops_when_lower_tier_stalls(registry) -> None:
    slow = SlowTier()
    store = TieredStore([CpuTier(1 << 20), slow], registry, chunk_size=4, queue_size=2, writers=1,
                        put_timeout_s=0.2, op_timeout_s=0.1)
    try:
        put_all(store)
        # the top tier took everything synchronously; the bounded queue refused the overflow
        assert store.consumer("pair-a", "consumer-m", "space-fp").contains(HASHES) == 6
        assert store.stats.value("dropped_writes", tier="slow") >= 1
    finally:
        store.close()


def test_writes_a_down_tier_missed_are_resynced_when_it_comes_back(registry) -> None:
    flaky = FailingTier()
    flaky.broken = True
    store = TieredStore([CpuTier(1 << 20), flaky], registry, chunk_size=4, backoff_min_s=0.01, backoff_max_s=0.05)
    try:
        t0 = time.monotonic()
        keys = put_all(store)
        store.flush()
        assert time.monotonic() - t0 < 2  # nothing waits on a down tier
        assert not flaky.data and store.stats.value("dropped_writes", tier="flaky") == 6
        assert store.write_behind.pending() == {"flaky": 6}
        flaky.broken = False
        deadline = time.monotonic() + 5
        while len(flaky.data) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(flaky.data) == sorted(keys) and store.stats.value("resynced_writes", tier="flaky") == 6
        assert store.write_behind.pending() == {"flaky": 0} and store.stats.value("lost_writes") == 0
    finally:
        assert store.close() == {}


def test_close_drains_within_its_deadline_and_reports_what_it_could_not_write(registry) -> None:
    flaky = FailingTier()
    flaky.broken = True
    store = TieredStore([CpuTier(1 << 20), flaky], registry, chunk_size=4, backoff_min_s=5.0, backoff_max_s=5.0)
    put_all(store)
    t0 = time.monotonic()
    assert store.close(timeout=0.2) == {"flaky": 6}
    assert time.monotonic() - t0 < 5 and store.stats.value("lost_writes", tier="flaky") == 6


def test_resync_is_bounded(registry) -> None:
    flaky = FailingTier()
    flaky.broken = True
    store = TieredStore([CpuTier(1 << 20), flaky], registry, chunk_size=4, backoff_min_s=5.0, backoff_max_s=5.0)
    store.write_behind.resync_keys = 4
    try:
        put_all(store)
        store.flush()
        assert store.write_behind.pending() == {"flaky": 4} and store.stats.value("lost_writes", tier="flaky") == 2
    finally:
        store.close(timeout=0.1)


def test_flush_waits_for_every_lower_tier(registry) -> None:
    slow = SlowTier()
    store = TieredStore([CpuTier(1 << 20), slow], registry, chunk_size=4, op_timeout_s=2.0)
    try:
        put_all(store, 2)
        store.flush()
        assert len(slow.data) == 2 and store.stats.value("bytes_written", tier="slow") > 0
    finally:
        store.close()


def test_each_tier_has_its_own_deadline(registry) -> None:
    slow = SlowTier()  # 0.5 s per put
    store = TieredStore([CpuTier(1 << 20), slow], registry, chunk_size=4, op_timeout_s=5.0,
                        tier_timeouts={"slow": 0.05})
    try:
        assert store.guard.timeouts == {"cpu": 5.0, "slow": 0.05}
        put_all(store, 1)
        store.flush()
        assert store.stats.value("tier_errors", tier="slow") == 1 and not slow.data  # its deadline, not 5 s
    finally:
        store.close()


def test_tier_deadlines_come_from_the_config(tmp_path, monkeypatch) -> None:
    skip_where_the_store_cannot_sign()  # a disk tier: the store signs with the host keyring
    from scd_store.store.build import open_store

    monkeypatch.setenv("SCD_STORE_HOME", str(tmp_path / "home"))  # its stats snapshot goes there
    from scd_store.store.config import StoreConfig, TierConfig

    config = StoreConfig(tiers=(TierConfig("cpu", max_bytes="1MiB"),
                                TierConfig("disk", path=str(tmp_path / "d"), max_bytes="1MiB", op_timeout_s=0.5)),
                         registry_path=str(tmp_path / "r.json"), op_timeout_s=3.0)
    store = open_store(config)
    try:
        assert store.guard.timeouts == {"cpu": 3.0, "disk": 0.5}
    finally:
        store.close()
