"""Revocation and change of registry records reach a running store within ``registry_refresh_s``."""

from __future__ import annotations

import time

import pytest

from scd_store.store.records import NotRegistered
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from tests.store.conftest import HASHES, PAIR, SPACE, put_all


def wait_until(check, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def refused(fn) -> bool:
    try:
        fn()
    except NotRegistered:
        return True
    return False


def test_a_revoked_pair_stops_being_served_and_comes_back_when_registered_again(registry) -> None:
    with TieredStore([CpuTier(1 << 20)], registry, chunk_size=4, registry_refresh_s=0.05) as store:
        put_all(store)
        consumer = lambda: store.consumer("pair-a", "consumer-m", "space-fp")  # noqa: E731
        assert consumer().contains(HASHES) == 6
        t0 = time.monotonic()
        assert registry.revoke("pair-a") == [PAIR.ident]
        assert wait_until(lambda: refused(consumer))
        assert time.monotonic() - t0 < 1.0  # bounded by registry_refresh_s (0.05 s) plus a read
        assert store.stats.value("registry_refreshes") >= 1
        registry.register_pair(PAIR)
        assert wait_until(lambda: not refused(consumer))


def test_revoking_a_space_stops_its_producer(registry) -> None:
    with TieredStore([CpuTier(1 << 20)], registry, chunk_size=4, registry_refresh_s=0.05) as store:
        assert len(put_all(store)) == 6
        registry.revoke("space-a")
        assert wait_until(lambda: refused(lambda: store.producer("space-a", "producer-m", "space-fp")))
        assert refused(lambda: store.consumer("pair-a", "consumer-m", "space-fp"))  # its pairs went with it
        registry.register_space(SPACE)
        registry.register_pair(PAIR)
        assert wait_until(lambda: not refused(lambda: store.producer("space-a", "producer-m", "space-fp")))


def test_without_refresh_the_first_answer_stays(registry) -> None:
    with TieredStore([CpuTier(1 << 20)], registry, chunk_size=4, registry_refresh_s=0) as store:
        store.consumer("pair-a", "consumer-m", "space-fp")
        registry.revoke("pair-a")
        time.sleep(0.2)
        store.consumer("pair-a", "consumer-m", "space-fp")  # documented: 0 means never re-read
        with pytest.raises(NotRegistered):
            store.forget_registry_cache() or store.consumer("pair-a", "consumer-m", "space-fp")
