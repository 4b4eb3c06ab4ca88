from __future__ import annotations

import asyncio
import os

from scd_store.store.keys import chunk_hashes, hash_keys
from scd_store.store.tiers.disk import DiskTier

KEYS = hash_keys("sp", chunk_hashes(list(range(40)), 4))


def run(coro):
    return asyncio.run(coro)


def test_round_trip_and_layout(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    run(tier.start())
    run(tier.put_many([(KEYS[0], b"hello"), (KEYS[1], b"world")]))
    assert run(tier.get_many([KEYS[0], KEYS[1], KEYS[2]])) == [b"hello", b"world", None]
    assert tier.path_for(KEYS[0]).is_file() and tier.path_for(KEYS[0]).parent.parent.name == "sp"
    assert run(tier.contains_many(KEYS[:3])) == [True, True, False]
    assert run(tier.delete(KEYS[0])) and not tier.path_for(KEYS[0]).exists()
    assert tier.usage().items == 1 and tier.usage().bytes_used == 5


def test_byte_bound_evicts_oldest(tmp_path) -> None:
    evicted: list[str] = []
    tier = DiskTier(tmp_path, 100)
    tier.set_evict_listener(lambda t, k, n: evicted.append(k))
    run(tier.start())
    for key in KEYS[:5]:
        run(tier.put(key, b"x" * 30))
    assert tier.usage().bytes_used <= 100
    assert evicted == KEYS[:2]
    assert not tier.path_for(KEYS[0]).exists() and tier.path_for(KEYS[4]).exists()


def test_index_rebuilt_on_start_and_temp_files_removed(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    run(tier.start())
    for i, key in enumerate(KEYS[:3]):
        run(tier.put(key, bytes([i]) * 10))
        os.utime(tier.path_for(key), (1000 + i, 1000 + i))
    stale = tier.path_for(KEYS[0]).with_name("leftover.abc.tmp")
    stale.write_bytes(b"half")
    again = DiskTier(tmp_path, 25)  # smaller bound: the oldest file goes
    run(again.start())
    assert not stale.exists()
    assert run(again.get_many(KEYS[:3])) == [None, b"\x01" * 10, b"\x02" * 10]
    assert again.usage().bytes_used == 20


def test_write_is_atomic_rename(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    run(tier.start())
    run(tier.put(KEYS[0], b"old"))
    run(tier.put(KEYS[0], b"new value"))
    assert run(tier.get(KEYS[0])) == b"new value"
    assert tier.usage().bytes_used == 9
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []
