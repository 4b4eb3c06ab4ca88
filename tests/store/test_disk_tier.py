from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import pytest

from scd_store.store.keys import chunk_hashes, generation_of, hash_keys
from scd_store.store.tiers.base import TierError
from scd_store.store.tiers.disk import DiskTier

KEYS = hash_keys("sp", generation_of("fp"), chunk_hashes(list(range(40)), 4))


def run(coro):
    return asyncio.run(coro)


def test_round_trip_and_layout(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    run(tier.start())
    run(tier.put_many([(KEYS[0], b"hello"), (KEYS[1], b"world")]))
    assert run(tier.get_many([KEYS[0], KEYS[1], KEYS[2]])) == [b"hello", b"world", None]
    assert tier.path_for(KEYS[0]).is_file() and tier.path_for(KEYS[0]).parent.parent.parent.name == "sp"
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
    os.utime(stale, (1000, 1000))  # hours old: its writer is long gone
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


def test_a_blob_another_process_wrote_is_found(tmp_path) -> None:
    first, second = DiskTier(tmp_path, 1 << 20), DiskTier(tmp_path, 1 << 20)  # two processes, one directory
    run(first.start())
    run(second.start())
    run(first.put(KEYS[0], b"written after the second one started"))
    assert run(second.contains_many(KEYS[:2])) == [True, False]
    assert run(second.get(KEYS[0])) == b"written after the second one started"
    assert second.usage().items == 1 and second.usage().bytes_used == 36
    run(first.delete(KEYS[0]))
    assert run(second.get(KEYS[0])) is None and second.usage().items == 0  # gone from disk: forgotten


def test_temp_files_of_live_writers_survive_a_start(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    run(tier.start())
    run(tier.put(KEYS[0], b"x"))
    folder = tier.path_for(KEYS[0]).parent
    live = folder / f"blob.scdb.{os.getpid()}.aaaa.tmp"  # this process, mid-write
    dead = folder / "blob.scdb.999999999.bbbb.tmp"  # no such process
    for path in (live, dead):
        path.write_bytes(b"half")
    run(DiskTier(tmp_path, 1 << 20).start())
    assert live.exists() and not dead.exists()


def test_a_rescan_keeps_the_byte_bound_across_processes(tmp_path) -> None:
    first, second = DiskTier(tmp_path, 100, rescan_s=None), DiskTier(tmp_path, 100, rescan_s=None)
    run(first.start())
    run(second.start())
    for i in range(3):
        run(first.put(KEYS[i], b"a" * 30))
        os.utime(first.path_for(KEYS[i]), (1000 + i, 1000 + i))
        run(second.put(KEYS[5 + i], b"b" * 30))
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.scdb"))
    assert on_disk == 180  # each process alone is within its bound
    second.rebuild_index()  # what the periodic rescan does
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.scdb")) <= 100
    assert not first.path_for(KEYS[0]).exists()  # the least recently used went first


def test_the_rescan_runs_in_the_background(tmp_path) -> None:
    async def go() -> int:
        first, second = DiskTier(tmp_path, 1 << 20), DiskTier(tmp_path, 1 << 20, rescan_s=0.05)
        await first.start()
        await second.start()
        await first.put(KEYS[0], b"new")
        await asyncio.sleep(0.3)
        items = second.usage().items
        await second.close()
        return items

    assert run(go()) == 1


def test_the_value_bound_is_at_most_the_byte_bound(tmp_path) -> None:
    assert DiskTier(tmp_path, 1 << 30).max_value_bytes == 64 << 20  # the default
    assert DiskTier(tmp_path, 1 << 30, max_value_bytes=1 << 20).max_value_bytes == 1 << 20
    assert DiskTier(tmp_path, 100, max_value_bytes=1 << 20).max_value_bytes == 100
    assert DiskTier(tmp_path, 100, max_value_bytes=None).max_value_bytes == 100
    tier = DiskTier(tmp_path, 1 << 20, max_value_bytes=8)
    assert tier.accepts(8) and not tier.accepts(9)
    for bad in ({"max_bytes": 0}, {"max_value_bytes": 0}, {"rescan_s": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DiskTier(tmp_path, **{"max_bytes": 1 << 20, **bad})


def test_get_many_keeps_the_order_of_its_keys(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    run(tier.start())
    run(tier.put_many([(key, bytes([i]) * (i + 1)) for i, key in enumerate(KEYS[:8])]))
    wanted = [KEYS[7], KEYS[9], KEYS[0], KEYS[3], KEYS[3]]
    assert run(tier.get_many(wanted)) == [b"\x07" * 8, None, b"\x00", b"\x03" * 4, b"\x03" * 4]
    assert tier.usage().items == 8


def test_close_releases_the_root_once_no_job_uses_it(tmp_path) -> None:
    """The tier holds an fd of its root (a tmpfs under it could not be unmounted): close() lets it go, but only
    after the jobs still running on its pool are done with it."""
    root = tmp_path / "root"
    tier = DiskTier(root, 1 << 20)

    def holders() -> list[str]:
        found = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == str(root):
                    found.append(fd)
        return found

    async def go() -> tuple[bool, bytes | None, list[str]]:
        await tier.start()
        await tier.put(KEYS[0], b"blob")
        gate, reading = threading.Event(), tier._read
        tier._read = lambda where: (gate.wait(5), reading(where))[1]  # type: ignore[method-assign]
        pending = asyncio.ensure_future(tier.get(KEYS[0]))
        await asyncio.sleep(0.05)
        await tier.close()
        held_while_reading = bool(holders())
        gate.set()
        return held_while_reading, await pending, holders()

    held_while_reading, value, after = run(go())
    assert held_while_reading and value == b"blob" and after == []
    with pytest.raises(TierError, match="closed"):
        run(tier.get(KEYS[0]))
