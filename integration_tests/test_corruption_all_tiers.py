"""Flip, truncate and extend stored blobs in every tier (CPU, disk, Redis): each case is a detected miss,
evicted and counted, and the codec never decodes a bad blob."""

from __future__ import annotations

import random

import pytest

from integration_tests.redis_servers import RedisServer
from scd_store.service import KVService
from scd_store.store.keys import generation_of, make_key
from scd_store.store.registry import FileRegistry
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.disk import DiskTier
from scd_store.store.tiers.redis_tier import RedisTier
from tests.bundles import PRODUCER, correlated_state, write_tiny_bundle

CASES = ("flip-header", "flip-payload", "flip-checksum", "random-bytes", "truncate", "extend", "empty")


def corrupt(blob: bytes, case: str, rng: random.Random) -> bytes:
    data = bytearray(blob)
    if case == "flip-header":
        data[rng.randrange(4, 40)] ^= 0x10
    elif case == "flip-payload":
        data[rng.randrange(60, len(data) - 16)] ^= 0x01
    elif case == "flip-checksum":
        data[-1] ^= 0x80
    elif case == "random-bytes":
        data = bytearray(rng.randbytes(len(data)))
    elif case == "truncate":
        data = data[:rng.randrange(1, len(data))]
    elif case == "extend":
        data += b"\x00" * rng.randint(1, 64)
    else:
        data = bytearray()
    return bytes(data)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


@pytest.mark.parametrize("tier_kind", ["cpu", "disk", "redis"])
def test_every_corruption_is_a_counted_evicted_miss_never_decoded(tier_kind, server, tmp_path, monkeypatch):
    write_tiny_bundle(tmp_path / "bundle")
    tier = {"cpu": lambda: CpuTier(8 << 20), "disk": lambda: DiskTier(tmp_path / "disk", 64 << 20),
            "redis": lambda: RedisTier(server.url)}[tier_kind]()
    store = TieredStore([tier], FileRegistry(tmp_path / "registry.json"), chunk_size=8)
    service = KVService(store, [tmp_path / "bundle"])
    decoded = []
    codec = service.binding("consumer-a").codec
    original = codec.decode
    monkeypatch.setattr(codec, "decode", lambda payload, **kw: decoded.append(1) or original(payload, **kw))
    rng = random.Random(7)
    try:
        for n, case in enumerate(CASES):
            hashes = [bytes([n, i]) * 8 for i in range(3)]
            parts = [correlated_state(8, start=8 * i, seed=n) for i in range(3)]
            parts = [type(p)(p.keys, p.values, start=8 * i) for i, p in enumerate(parts)]
            service.put(PRODUCER, hashes, parts)
            store.flush()
            bad_key = make_key("tiny-space", generation_of(codec.space.fingerprint), hashes[1])
            good = store._loop.run(tier.get(bad_key), timeout=5)
            store._loop.run(tier.put(bad_key, corrupt(good, case, rng)), timeout=5)
            before = store.stats.value("corrupt_blobs")
            decoded.clear()
            states = service.get("consumer-a", hashes)
            assert len(states) == 1, case  # the run stops at the bad chunk
            assert len(decoded) == 1, case  # only the good chunk reached the codec
            assert store.stats.value("corrupt_blobs") == before + 1, case
            present = store._loop.run(tier.contains(bad_key), timeout=5)
            if tier.shared:  # a reader never deletes from a shared tier: it reports, the producer quarantines
                assert present, case
                assert store.repair_now() == (1, 0), case
                present = store._loop.run(tier.contains(bad_key), timeout=5)
            assert not present, case  # deleted (by the reader on this host's tiers, else by the producer)
    finally:
        store.close()
