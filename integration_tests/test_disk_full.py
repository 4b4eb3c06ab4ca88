"""A full disk under the disk tier (a small tmpfs): requests complete, errors are counted, the tier recovers."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from integration_tests.store_ops import get_tokens, keys_of, put_tokens
from scd_store.store.registry import FileRegistry, Pair, Space
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.disk import DiskTier

TOKENS = list(range(4 * 8))
PAYLOADS = [bytes([i]) * (40 << 10) for i in range(8)]


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "fs"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True,
                            check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_full_disk_is_a_counted_miss_and_recovers(small_fs, tmp_path):
    registry = FileRegistry(tmp_path / "registry.json")
    registry.register_space(Space("sp", "prod", "p-fp", "s-fp", chunk_size=4))
    registry.register_pair(Pair("pair", "sp", "cons", "c-fp", "pair-fp", "s-fp"))
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (400 << 10))  # leaves ~100 KiB: two 40 KiB blobs fit, then ENOSPC
    disk = DiskTier(small_fs / "store", 64 << 20)
    store = TieredStore([CpuTier(16 << 20), disk], registry, chunk_size=4, backoff_min_s=0.05, backoff_max_s=0.2,
                        put_timeout_s=5.0)
    try:
        t0 = time.monotonic()
        put_tokens(store, "sp", "prod", TOKENS, PAYLOADS)
        store.flush()
        assert time.monotonic() - t0 < 10  # nothing hangs
        assert store.stats.value("tier_errors", tier=disk.name) >= 1
        chunks = get_tokens(store, "pair", "cons", TOKENS)  # served from the CPU tier regardless
        assert [bytes(c.payload) for c in chunks] == PAYLOADS
        leftovers = [p for p in (small_fs / "store").rglob("*") if p.name.endswith(".tmp")]
        assert leftovers == []  # no half-written files left behind
        on_disk = store._loop.run(disk.contains_many(store_keys(store)), timeout=5)
        assert 0 < sum(on_disk) < len(PAYLOADS)
        # free the space: the re-sync probes the tier, it recovers by itself, and the blobs it missed are
        # written from the CPU tier without another put (dropped_writes, then resynced_writes)
        assert store.stats.value("dropped_writes", tier=disk.name) > 0
        os.unlink(filler)
        deadline = time.monotonic() + 10
        while not all(store._loop.run(disk.contains_many(store_keys(store)), timeout=5)):
            assert time.monotonic() < deadline, "the disk tier never got the blobs it missed"
            time.sleep(0.1)
        assert store.stats.value("resynced_writes", tier=disk.name) > 0
        assert store.stats.value("lost_writes", tier=disk.name) == 0
    finally:
        store.close()


def store_keys(store: TieredStore) -> list[str]:
    return keys_of("sp", "s-fp", TOKENS, store.chunk_size)
