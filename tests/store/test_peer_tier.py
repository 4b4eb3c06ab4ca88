"""The peer tier over the in-process copy transfer and a file directory (NIXL between processes is
in integration_tests/test_peer_processes.py)."""

from __future__ import annotations

import asyncio

from scd_store.store.keys import chunk_hashes, generation_of, hash_keys
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.peer import PeerTier
from scd_store.store.transfer.directory import FilePeerDirectory
from tests.store.conftest import HASHES, PAYLOADS, put_all

KEYS = hash_keys("sp", generation_of("fp"), chunk_hashes(list(range(40)), 4))


def run(coro):
    return asyncio.run(coro)


def pair(tmp_path, publish_bytes=1 << 16):
    source = PeerTier(FilePeerDirectory(tmp_path / "peers"), publish_bytes=publish_bytes, transfer="copy")
    reader = PeerTier(FilePeerDirectory(tmp_path / "peers"), transfer="copy")
    run(source.start())
    run(reader.start())
    return source, reader


def test_a_reader_finds_what_a_source_published(tmp_path):
    source, reader = pair(tmp_path)
    run(source.put_many([(KEYS[0], b"alpha"), (KEYS[1], b"beta")]))
    assert run(reader.contains_many(KEYS[:3])) == [True, True, False]
    assert run(reader.get_many(KEYS[:3])) == [b"alpha", b"beta", None]
    run(reader.put_many([(KEYS[2], b"nothing kept")]))  # a read-only peer tier holds nothing of its own
    assert run(source.get_many([KEYS[2]])) == [None]


def test_a_wrapped_arena_reads_other_bytes_and_a_forgotten_location_is_a_miss(tmp_path):
    source, reader = pair(tmp_path, publish_bytes=10)
    run(source.put_many([(KEYS[0], b"aaaaaa")]))
    run(source.put_many([(KEYS[1], b"bbbbbb")]))  # wraps: overwrites where KEYS[0] was
    stale = run(reader.get_many([KEYS[0]]))[0]
    assert stale != b"aaaaaa"  # the store's blob checksum turns this into a miss (next test)
    run(reader.delete_many([KEYS[0]]))
    assert run(reader.contains_many([KEYS[0]])) == [False]
    run(source.put_many([(KEYS[0], b"cc")]))  # published anew: visible again
    assert run(reader.get_many([KEYS[0]])) == [b"cc"]


def test_in_the_store_walk_a_peer_hit_is_verified_and_promoted(tmp_path, registry):
    producer_side = TieredStore([CpuTier(1 << 20), PeerTier(FilePeerDirectory(tmp_path / "peers"),
                                                              publish_bytes=1 << 20, transfer="copy")],
                                registry, chunk_size=4)
    consumer_side = TieredStore([CpuTier(1 << 20), PeerTier(FilePeerDirectory(tmp_path / "peers"),
                                                              transfer="copy")], registry, chunk_size=4)
    try:
        put_all(producer_side)
        producer_side.flush()
        consumer = consumer_side.consumer("pair-a", "consumer-m", "space-fp")
        chunks = consumer.get(HASHES)
        assert [bytes(c.payload) for c in chunks] == PAYLOADS and {c.tier for c in chunks} == {"peer"}
        assert consumer.lookup(HASHES).tiers == ("cpu",) * 6  # promoted
        source = producer_side.tiers[1].source
        source.arena.buffer.zero_()  # every published blob is now garbage
        consumer_side.tiers[0].delete_now(chunks[0].key)
        assert consumer.get(HASHES) == []  # verification refused it: a miss, counted, never garbage
        assert consumer_side.stats.value("corrupt_blobs", tier="peer") == 1
    finally:
        producer_side.close()
        consumer_side.close()


def test_a_store_publishes_only_the_spaces_it_produces(tmp_path, registry):
    """A consumer whose peer tier publishes promotes what it reads from the disk into it, and publishes none of
    it: only a space's producer publishes that space's blobs."""
    from scd_store.store.tiers.disk import DiskTier

    with TieredStore([DiskTier(tmp_path / "disk", 1 << 20)], registry, chunk_size=4) as producer_side:
        put_all(producer_side)
    consumer_side = TieredStore([PeerTier(FilePeerDirectory(tmp_path / "peers"), publish_bytes=1 << 20,
                                          transfer="copy"), DiskTier(tmp_path / "disk", 1 << 20)],
                                registry, chunk_size=4)
    reader = PeerTier(FilePeerDirectory(tmp_path / "peers"), transfer="copy")
    run(reader.start())
    try:
        consumer = consumer_side.consumer("pair-a", "consumer-m", "space-fp")
        assert [bytes(c.payload) for c in consumer.get(HASHES)] == PAYLOADS
        consumer_side.flush()
        assert consumer_side.stats.value("promotions", tier="peer") == 6  # handed to the peer tier ...
        assert run(reader.contains_many(consumer.keys(HASHES))) == [False] * 6  # ... which published none
        assert not consumer_side.produces("space-a")
        put_all(consumer_side)  # the same process as the space's producer: now it publishes what it writes
        consumer_side.flush()
        assert consumer_side.produces("space-a")
        assert run(reader.contains_many(consumer.keys(HASHES))) == [True] * 6
    finally:
        consumer_side.close()
        run(reader.close())
