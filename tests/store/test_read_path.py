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
    assert not store.tiers[0].contains_now(keys[3])
    assert not store.tiers[1].path_for(keys[3]).exists()


def test_blob_from_another_space_fingerprint_is_rejected(store, registry) -> None:
    from scd_store.store.registry import Space

    put_all(store)  # written under fingerprint "space-fp"
    registry.register_space(Space("space-a", "producer-m", "prod-fp", "space-fp-v2", chunk_size=4), replace=True)
    store.forget_registry_cache()
    assert store.consumer("pair-a", "consumer-m").get(HASHES) == []
    assert store.stats.value("corrupt_blobs") >= 1
