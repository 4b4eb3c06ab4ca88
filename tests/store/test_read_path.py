"""The read path: leading runs, verification of every blob, promotion of lower-tier hits."""

from __future__ import annotations

import asyncio

from scd_store.store.keys import chunk_hashes
from tests.store.conftest import HASHES, PAYLOADS, TOKENS, put_all


def test_put_get_round_trip(store, consumer) -> None:
    keys = put_all(store)
    assert len(keys) == 6
    chunks = consumer.get(HASHES)
    assert [bytes(c.payload) for c in chunks] == PAYLOADS
    assert [c.index for c in chunks] == list(range(6)) and all(c.tier == "cpu" for c in chunks)
    assert chunks[0].meta.space_fingerprint == "space-fp" and chunks[0].token_count == 4
    assert consumer.contains(HASHES) == 6
    assert store.stats.value("hit_chunks", tier="cpu", pair="pair-a") == 6


def test_longest_leading_run(store, consumer) -> None:
    put_all(store, 3)
    assert consumer.contains(HASHES) == 3
    assert consumer.contains(chunk_hashes(TOKENS[:11], 4)) == 2
    other = [1000] + TOKENS[1:]
    assert consumer.contains(chunk_hashes(other, 4)) == 0


def test_gap_stops_the_run(store, consumer) -> None:
    keys = put_all(store)
    store.flush()
    store.tiers[0].delete_now(keys[2])
    asyncio.run(store.tiers[1].delete(keys[2]))
    hit = consumer.lookup(HASHES)
    assert hit.hit_chunks == 2 and hit.total_chunks == 6
    assert len(consumer.get(HASHES)) == 2


def test_lower_tier_hit_is_promoted(store, consumer) -> None:
    keys = put_all(store)
    store.flush()
    assert store.tiers[1].usage().items == 6  # written through to disk
    for key in keys:
        store.tiers[0].delete_now(key)
    hit = consumer.lookup(HASHES)
    assert hit.tiers == ("disk",) * 6
    chunks = consumer.get(HASHES)
    assert [c.tier for c in chunks] == ["disk"] * 6 and [bytes(c.payload) for c in chunks] == PAYLOADS
    assert consumer.lookup(HASHES).tiers == ("cpu",) * 6
    assert store.stats.value("promotions", tier="cpu") == 6


def test_corrupt_blob_is_miss_evicted_counted(store, consumer) -> None:
    keys = put_all(store)
    store.flush()
    good = store.tiers[0].get_now(keys[1])
    bad = bytearray(good)
    bad[-20] ^= 0xFF
    store.tiers[0].put_now(keys[1], bytes(bad))
    chunks = consumer.get(HASHES)
    # the corrupt CPU copy is skipped; the disk copy serves chunk 1
    assert [bytes(c.payload) for c in chunks] == PAYLOADS and chunks[1].tier == "disk"
    assert store.stats.value("corrupt_blobs", tier="cpu") == 1
    assert store.tiers[0].get_now(keys[1]) == good  # evicted, then re-promoted from disk


def test_corrupt_everywhere_truncates_the_run(store, consumer) -> None:
    keys = put_all(store)
    store.flush()
    store.tiers[0].put_now(keys[3], b"garbage")
    asyncio.run(store.tiers[1].put(keys[3], b"garbage too"))
    chunks = consumer.get(HASHES)
    assert len(chunks) == 3
    assert store.stats.value("corrupt_blobs") == 2
    assert not store.tiers[0].contains_now(keys[3])  # this host's tiers: the reader deletes
    assert not store.tiers[1].path_for(keys[3]).exists()


def test_a_blob_of_another_generation_under_this_key_is_a_miss_never_deleted(store, registry) -> None:
    """A well-formed blob whose fingerprint is not the key's generation (planted or misrouted): a miss,
    counted as foreign, left where it is (another generation's reader may be right to hold it)."""
    from scd_store.store.blob import BlobMeta, encode_blob

    keys = put_all(store)
    store.flush()
    foreign = encode_blob(BlobMeta("raw", "space-fp-v2", 4), PAYLOADS[2], key=keys[2])
    store.tiers[0].put_now(keys[2], foreign)
    asyncio.run(store.tiers[1].put(keys[2], foreign))
    chunks = store.consumer("pair-a", "consumer-m", "space-fp").get(HASHES)
    assert len(chunks) == 2
    assert store.stats.value("foreign_blobs") == 2 and store.stats.value("corrupt_blobs") == 0
    assert store.tiers[0].get_now(keys[2]) == foreign and store.tiers[1].path_for(keys[2]).exists()


def test_header_bounds_are_checked_before_decoding(store) -> None:
    """A blob claiming more tokens than a chunk of its space holds is refused (corrupt), not served."""
    from scd_store.store.blob import BlobMeta, encode_blob

    keys = put_all(store)
    store.flush()
    store.tiers[0].put_now(keys[0], encode_blob(BlobMeta("raw", "space-fp", 1 << 40), PAYLOADS[0], key=keys[0]))
    asyncio.run(store.tiers[1].delete(keys[0]))
    assert store.consumer("pair-a", "consumer-m", "space-fp").get(HASHES) == []
    assert store.stats.value("corrupt_blobs") == 1


def test_a_report_that_fails_leaves_the_tier_serving(registry) -> None:
    """A consumer's report hash that is full (Redis out of memory) or refused must not make the tier's blobs
    misses: reports are on the side."""
    from scd_store.store.tiered import TieredStore
    from scd_store.store.tiers.cpu import CpuTier
    from tests.store.conftest import HASHES, FailingTier, put_all

    class NoReports(FailingTier):
        kind = "shared"
        shared = True

        async def report_hits(self, scope, keys):
            raise ConnectionError("OOM command not allowed when used memory > 'maxmemory'")

        report_suspects = report_hits

    tier = NoReports()
    store = TieredStore([CpuTier(1 << 20), tier], registry, chunk_size=4)
    try:
        keys = put_all(store)
        store.flush()
        for key in keys:
            store.tiers[0].delete_now(key)
        tier.data[keys[3]] = b"damaged"
        consumer = store.consumer("pair-a", "consumer-m", "space-fp")
        for _ in range(3):
            assert len(consumer.get(HASHES)) == 3  # up to the damaged blob, every time
            for key in keys[:3]:
                store.tiers[0].delete_now(key)
        assert not store.health["shared"].down and store.stats.value("tier_errors") == 0
    finally:
        store.close()
