from __future__ import annotations

import asyncio

import pytest

from scd_store.store.registry import NotAuthorized, NotRegistered
from scd_store.store.store import TieredStore
from scd_store.store.tiers.base import Tier, TierUsage
from scd_store.store.tiers.cpu import CpuTier

TOKENS = list(range(4 * 6 + 2))  # 6 whole chunks of 4, plus 2 unkeyed tokens
PAYLOADS = [bytes([i]) * (50 + i) for i in range(6)]


def put_all(store: TieredStore, n: int = 6) -> list[str]:
    return store.put("space-a", TOKENS, PAYLOADS[:n], producer="producer-m", codec_id="raw")


def test_put_get_round_trip(store) -> None:
    keys = put_all(store)
    assert len(keys) == 6
    consumer = store.consumer("pair-a", "consumer-m")
    chunks = consumer.get(TOKENS)
    assert [bytes(c.payload) for c in chunks] == PAYLOADS
    assert [c.index for c in chunks] == list(range(6)) and all(c.tier == "cpu" for c in chunks)
    assert chunks[0].meta.space_fingerprint == "space-fp" and chunks[0].token_count == 4
    assert consumer.contains_prefix(TOKENS) == 24
    assert store.stats.value("hit_chunks", tier="cpu", pair="pair-a") == 6


def test_longest_leading_run(store) -> None:
    put_all(store, 3)
    assert store.contains_prefix("space-a", TOKENS) == 12
    assert store.contains_prefix("space-a", TOKENS[:11]) == 8
    other = [1000] + TOKENS[1:]
    assert store.contains_prefix("space-a", other) == 0


def test_gap_stops_the_run(store) -> None:
    keys = put_all(store)
    store.flush()
    store.tiers[0].delete_now(keys[2])
    asyncio.run(store.tiers[1].delete(keys[2]))
    hit = store.lookup_prefix("space-a", TOKENS)
    assert hit.hit_chunks == 2 and hit.total_chunks == 6
    assert len(store.get("pair-a", TOKENS, consumer="consumer-m")) == 2


def test_lower_tier_hit_is_promoted(store) -> None:
    keys = put_all(store)
    store.flush()
    assert store.tiers[1].usage().items == 6  # written through to disk
    for key in keys:
        store.tiers[0].delete_now(key)
    hit = store.lookup_prefix("space-a", TOKENS)
    assert hit.tiers == ("disk",) * 6
    chunks = store.get("pair-a", TOKENS, consumer="consumer-m")
    assert [c.tier for c in chunks] == ["disk"] * 6 and [bytes(c.payload) for c in chunks] == PAYLOADS
    assert store.lookup_prefix("space-a", TOKENS).tiers == ("cpu",) * 6
    assert store.stats.value("promotions", tier="cpu") == 6


def test_corrupt_blob_is_miss_evicted_counted(store) -> None:
    keys = put_all(store)
    store.flush()
    good = store.tiers[0].get_now(keys[1])
    bad = bytearray(good)
    bad[-20] ^= 0xFF
    store.tiers[0].put_now(keys[1], bytes(bad))
    chunks = store.get("pair-a", TOKENS, consumer="consumer-m")
    # the corrupt CPU copy is skipped; the disk copy serves chunk 1
    assert [bytes(c.payload) for c in chunks] == PAYLOADS and chunks[1].tier == "disk"
    assert store.stats.value("corrupt_blobs", tier="cpu") == 1
    assert store.tiers[0].get_now(keys[1]) == good  # evicted, then re-promoted from disk


def test_corrupt_everywhere_truncates_the_run(store) -> None:
    keys = put_all(store)
    store.flush()
    store.tiers[0].put_now(keys[3], b"garbage")
    asyncio.run(store.tiers[1].put(keys[3], b"garbage too"))
    chunks = store.get("pair-a", TOKENS, consumer="consumer-m")
    assert len(chunks) == 3
    assert store.stats.value("corrupt_blobs") == 2
    assert not store.tiers[0].contains_now(keys[3])
    assert not store.tiers[1].path_for(keys[3]).exists()


def test_only_the_producer_writes_its_space(store) -> None:
    with pytest.raises(NotAuthorized, match="consumer-m"):
        store.put("space-a", TOKENS, PAYLOADS[:1], producer="consumer-m", codec_id="raw")
    with pytest.raises(NotRegistered):
        store.put("space-b", TOKENS, PAYLOADS[:1], producer="producer-m", codec_id="raw")
    view = store.consumer("pair-a", "consumer-m")
    assert not hasattr(view, "put")


def test_unregistered_consumer_gets_clear_error(store) -> None:
    with pytest.raises(NotRegistered, match="pair 'nope' is not registered"):
        store.consumer("nope", "consumer-m")
    with pytest.raises(NotRegistered, match="'intruder' is not registered for pair 'pair-a'"):
        store.get("pair-a", TOKENS, consumer="intruder")


def test_producer_view_and_too_many_payloads(store) -> None:
    view = store.producer("space-a", "producer-m")
    view.put(TOKENS, PAYLOADS[:2], codec_id="raw", layer_roles=("reuse",), bit_widths=(4,))
    assert view.contains_prefix(TOKENS) == 8
    assert store.get("pair-a", TOKENS, consumer="consumer-m")[0].meta.bit_widths == (4,)
    with pytest.raises(ValueError, match="7 payloads for 6 whole chunks"):
        view.put(TOKENS, PAYLOADS + [b"x"], codec_id="raw")


def test_blob_from_another_space_fingerprint_is_rejected(store, registry) -> None:
    from scd_store.store.registry import Space

    put_all(store)  # written under fingerprint "space-fp"
    registry.register_space(Space("space-a", "producer-m", "prod-fp", "space-fp-v2", chunk_size=4), replace=True)
    store.forget_registry_cache()
    assert store.get("pair-a", TOKENS, consumer="consumer-m") == []
    assert store.stats.value("corrupt_blobs") >= 1


class FailingTier(Tier):
    """A remote-like tier that fails while ``broken`` is set (no mocks of Redis: a real in-process tier)."""

    kind = "flaky"

    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        self.data: dict[str, bytes] = {}
        self.calls = 0

    def _check(self) -> None:
        self.calls += 1
        if self.broken:
            raise ConnectionError("tier unreachable")

    async def get(self, key):
        self._check()
        return self.data.get(key)

    async def put(self, key, value):
        self._check()
        self.data[key] = value

    async def contains(self, key):
        self._check()
        return key in self.data

    async def delete(self, key):
        self._check()
        return self.data.pop(key, None) is not None

    def usage(self) -> TierUsage:
        return TierUsage(len(self.data), sum(map(len, self.data.values())), None)


def test_failing_tier_is_a_miss_logged_once_and_recovers(registry, caplog) -> None:
    flaky = FailingTier()
    store = TieredStore([CpuTier(1 << 20), flaky], registry, chunk_size=4, backoff_min_s=0.01, backoff_max_s=0.02)
    try:
        keys = put_all(store)
        store.flush()
        assert len(flaky.data) == 6
        for key in keys:
            store.tiers[0].delete_now(key)
        flaky.broken = True
        with caplog.at_level("WARNING", logger="scd_store.store"):
            for _ in range(5):
                assert store.contains_prefix("space-a", TOKENS) == 0
                assert store.get("pair-a", TOKENS, consumer="consumer-m") == []
        assert store.stats.value("tier_errors", tier="flaky") >= 1
        assert sum("failed" in r.message for r in caplog.records) == 1
        flaky.broken = False
        import time

        deadline = time.monotonic() + 5
        while store.contains_prefix("space-a", TOKENS) != 24 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.contains_prefix("space-a", TOKENS) == 24
        assert not store.health["flaky"].down and store.health["flaky"].incidents == 1
    finally:
        store.close()


def test_back_pressure_blocks_then_drops_when_lower_tier_stalls(registry) -> None:
    class SlowTier(FailingTier):
        kind = "slow"

        async def put(self, key, value):
            await asyncio.sleep(0.5)
            self.data[key] = value

    slow = SlowTier()
    store = TieredStore([CpuTier(1 << 20), slow], registry, chunk_size=4, queue_size=2, writers=1,
                        put_timeout_s=0.2, op_timeout_s=0.1)
    try:
        put_all(store)
        # the top tier took everything synchronously; the bounded queue refused the overflow
        assert store.contains_prefix("space-a", TOKENS) == 24
        assert store.stats.value("rejected_blobs", tier="slow") >= 1
    finally:
        store.close()
