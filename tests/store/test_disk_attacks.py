"""The disk tier under attack: whatever is planted under its root, it never hangs, never reads past its bound,
never follows a link, and never occupies the event loop's default executor. Each test plays one attack."""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import socket
import stat
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from scd_store.store.fs_safety import UnsafePath
from scd_store.store.keys import chunk_hashes, generation_of, hash_keys
from scd_store.store.tiers import disk
from scd_store.store.tiers.base import TierError
from scd_store.store.tiers.disk import DiskTier, read_bounded

KEYS = hash_keys("sp", generation_of("fp"), chunk_hashes(list(range(64)), 4))
BLOB = b"a valid-looking blob" * 4


def bounded(make: Callable[[], Awaitable[Any]], timeout: float = 5.0) -> Any:
    """Run ``make()`` on a loop of its own in a daemon thread: the test fails (instead of hanging) past ``timeout``."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = asyncio.run(make())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the disk tier hung for more than {timeout} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def counted(tier: DiskTier) -> collections.Counter[str]:
    """The tier's counters, as the store's ``count`` would get them."""
    counts: collections.Counter[str] = collections.Counter()
    tier.attach(keyring=None, count=lambda name, n: counts.update({name: n}))
    return counts


def make_tier(root: Path, **kw: Any) -> tuple[DiskTier, collections.Counter[str]]:
    tier = DiskTier(root, kw.pop("max_bytes", 1 << 20), rescan_s=None, **kw)
    return tier, counted(tier)


def plant(tier: DiskTier, key: str) -> Path:
    """The blob path of ``key`` with its directories made and nothing in it."""
    path = tier.path_for(key)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    assert not os.path.lexists(path)
    return path


def gone(path: Path) -> bool:
    return not os.path.lexists(path)


def test_a_symlink_to_dev_zero_is_a_quick_bounded_miss(tmp_path) -> None:
    tier, counts = make_tier(tmp_path / "root", max_value_bytes=1 << 20)
    bounded(lambda: tier.put(KEYS[0], BLOB))
    path = tier.path_for(KEYS[0])
    path.unlink()
    path.symlink_to("/dev/zero")  # an endless source where the blob was
    plant(tier, KEYS[1]).symlink_to("/dev/zero")  # and where none was indexed (another process's blob)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        values = bounded(lambda: tier.get_many(KEYS[:2]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert values == [None, None]
    assert time.monotonic() - t0 < 1.0
    assert peak < 256 << 10  # nothing of /dev/zero was read
    assert gone(path) and gone(tier.path_for(KEYS[1]))
    assert counts["unsafe_files"] == 2 and tier.usage().items == 0
    assert Path("/dev/zero").exists()  # unlink removed the link, not what it points at


def test_a_symlink_to_a_large_file_outside_the_root_is_never_read(tmp_path) -> None:
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"S" * (4 << 20))
    tier, counts = make_tier(tmp_path / "root", max_bytes=64 << 20)
    plant(tier, KEYS[0]).symlink_to(outside)
    plant(tier, KEYS[1]).symlink_to(tmp_path / "root" / "sp")  # a link to a directory of the tier itself
    assert bounded(lambda: tier.get(KEYS[0])) is None
    assert bounded(lambda: tier.contains_many(KEYS[:2])) == [False, False]
    assert gone(tier.path_for(KEYS[0])) and gone(tier.path_for(KEYS[1]))
    assert outside.stat().st_size == 4 << 20 and outside.read_bytes()[:1] == b"S"  # untouched
    assert counts["unsafe_files"] == 2


def test_a_fifo_at_a_blob_path_does_not_block(tmp_path) -> None:
    tier, counts = make_tier(tmp_path / "root")
    bounded(lambda: tier.put(KEYS[0], BLOB))
    path = tier.path_for(KEYS[0])
    path.unlink()
    os.mkfifo(path)  # opening it for reading would wait for a writer that never comes
    t0 = time.monotonic()
    assert bounded(lambda: tier.get(KEYS[0]), timeout=3.0) is None
    assert time.monotonic() - t0 < 1.0
    assert gone(path) and counts["unsafe_files"] == 1 and tier.usage().items == 0
    os.mkfifo(plant(tier, KEYS[1]))
    assert bounded(lambda: tier.contains(KEYS[1]), timeout=3.0) is False
    assert gone(tier.path_for(KEYS[1])) and counts["unsafe_files"] == 2


def test_a_socket_and_a_device_are_misses(tmp_path, monkeypatch) -> None:
    tier, counts = make_tier(tmp_path / "root")
    path = plant(tier, KEYS[0])
    monkeypatch.chdir(path.parent)  # a relative name: the full path is too long for AF_UNIX
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path.name)
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    planted = 1
    try:
        os.mknod(plant(tier, KEYS[1]), 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's own node
        planted += 1
    except (PermissionError, OSError):
        pass
    assert bounded(lambda: tier.get_many(KEYS[:2])) == [None, None]
    assert gone(tier.path_for(KEYS[0])) and gone(tier.path_for(KEYS[1]))
    assert counts["unsafe_files"] == planted


@pytest.mark.parametrize("level", [0, 1, 2], ids=["space", "generation", "prefix"])
def test_a_symlinked_directory_is_not_followed(tmp_path, level) -> None:
    """A directory of the layout replaced by a link to a tree holding a valid-looking blob."""
    tier, counts = make_tier(tmp_path / "root")
    bounded(lambda: tier.put(KEYS[0], BLOB))
    inside = tier.path_for(KEYS[0]).parents[2 - level]  # root/sp, root/sp/gen or root/sp/gen/xx
    decoy = tmp_path / "decoy" / inside.relative_to(tmp_path / "root")
    decoy.parent.mkdir(parents=True)
    inside.rename(decoy)  # the blob now lives outside the root
    inside.symlink_to(decoy, target_is_directory=True)
    assert bounded(lambda: tier.get(KEYS[0])) is None
    assert gone(inside) and counts["unsafe_files"] == 1
    decoy_blob = decoy.joinpath(*tier.path_for(KEYS[0]).parts[len(inside.parts):])
    assert decoy_blob.read_bytes() == BLOB  # the link went, not its target
    # a write through the same planted link lands in a real directory of the root, not the decoy
    inside.symlink_to(decoy, target_is_directory=True)
    bounded(lambda: tier.put(KEYS[0], b"new"))
    assert not inside.is_symlink() and tier.path_for(KEYS[0]).read_bytes() == b"new"
    assert decoy_blob.read_bytes() == BLOB and counts["unsafe_files"] == 2


def test_a_regular_file_over_the_bound_is_removed_unread(tmp_path) -> None:
    tier, counts = make_tier(tmp_path / "root", max_value_bytes=1024)
    assert tier.max_value_bytes == 1024 and not tier.accepts(1025)
    plant(tier, KEYS[0]).write_bytes(b"x" * 4096)
    assert bounded(lambda: tier.contains(KEYS[0])) is False
    plant(tier, KEYS[1]).write_bytes(b"x" * 4096)
    assert bounded(lambda: tier.get(KEYS[1])) is None
    assert gone(tier.path_for(KEYS[0])) and gone(tier.path_for(KEYS[1])) and counts["unsafe_files"] == 2
    bounded(lambda: tier.put(KEYS[2], b"y" * 2048))  # too large to store: nothing is written
    assert gone(tier.path_for(KEYS[2])) and tier.usage().items == 0


def test_a_file_that_grows_while_read_is_cut_at_the_bound() -> None:
    """``read_bounded`` reads at most bound + 1 bytes whatever fstat said (a pipe stands in for a growing file)."""
    r, w = os.pipe()
    try:
        os.write(w, b"z" * 200)
        os.close(w)
        w = -1
        assert read_bounded(r, 10, 100) is None  # said 10 bytes, holds 200: over the bound of 100
        assert os.read(r, 1000) == b"z" * 99  # it stopped at 101
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    r, w = os.pipe()
    os.write(w, b"q" * 50)
    os.close(w)
    assert read_bounded(r, 10, 100) == b"q" * 50
    os.close(r)


def test_a_directory_where_a_blob_belongs_is_a_miss_and_a_put_replaces_it(tmp_path) -> None:
    tier, counts = make_tier(tmp_path / "root")
    path = plant(tier, KEYS[0])
    (path / "inner").mkdir(parents=True)
    (path / "inner" / "f").write_bytes(b"junk")
    assert bounded(lambda: tier.get(KEYS[0])) is None
    assert gone(path) and counts["unsafe_files"] == 1
    path.mkdir()
    bounded(lambda: tier.put(KEYS[0], BLOB))
    assert path.read_bytes() == BLOB and counts["unsafe_files"] == 2
    assert bounded(lambda: tier.get(KEYS[0])) == BLOB


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o1777])
def test_a_root_others_may_write_is_refused(tmp_path, mode) -> None:
    root = tmp_path / "root"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(UnsafePath):
        DiskTier(root, 1 << 20)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_root_another_user_owns_is_refused(tmp_path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(UnsafePath, match="uid 65534"):
        DiskTier(root, 1 << 20)


def test_a_missing_root_is_made_private(tmp_path) -> None:
    tier, _ = make_tier(tmp_path / "a" / "root")
    assert stat.S_IMODE(os.stat(tier.root).st_mode) == 0o700


def test_scan_and_rebuild_skip_and_remove_planted_entries(tmp_path) -> None:
    root = tmp_path / "root"
    tier, _ = make_tier(root, max_value_bytes=1024)
    for key in KEYS[:2]:
        bounded(lambda k=key: tier.put(k, BLOB))
    decoy = tmp_path / "decoy"
    decoy.mkdir()

    def plant_all() -> list[Path]:
        os.mkfifo(plant(tier, KEYS[2]))
        plant(tier, KEYS[3]).symlink_to("/dev/zero")
        plant(tier, KEYS[4]).mkdir()
        plant(tier, KEYS[5]).write_bytes(b"x" * 2048)  # over the bound
        other_space = hash_keys("other", generation_of("fp"), chunk_hashes(list(range(4)), 4))[0]
        (decoy / "sp-decoy").mkdir(exist_ok=True)
        link = root / "other"
        link.symlink_to(decoy, target_is_directory=True)  # a space directory that is a link
        return [tier.path_for(k) for k in KEYS[2:6]] + [link, tier.path_for(other_space)]

    planted = plant_all()
    again, counts = make_tier(root, max_value_bytes=1024)
    bounded(again.start)
    assert again.usage().items == 2 and bounded(lambda: again.get_many(KEYS[:2])) == [BLOB, BLOB]
    assert all(gone(p) for p in planted) and counts["unsafe_files"] == 5
    assert decoy.is_dir() and (decoy / "sp-decoy").is_dir()  # the link's target is left alone
    planted = plant_all()
    again.rebuild_index()  # the synchronous rebuild does the same
    assert again.usage().items == 2 and all(gone(p) for p in planted) and counts["unsafe_files"] == 10


def test_unsafe_entries_are_logged_once_per_tier(tmp_path, caplog) -> None:
    tier, counts = make_tier(tmp_path / "root")
    for key in KEYS[:3]:
        os.mkfifo(plant(tier, key))
    with caplog.at_level(logging.WARNING, logger="scd_store.store"):
        for key in KEYS[:3]:
            assert bounded(lambda k=key: tier.get(k)) is None
    lines = [r for r in caplog.records if "unsafe_files" in r.getMessage()]
    assert len(lines) == 1 and counts["unsafe_files"] == 3


def test_a_genuine_io_error_is_a_tier_error(tmp_path, monkeypatch) -> None:
    tier, counts = make_tier(tmp_path / "root")
    bounded(lambda: tier.put(KEYS[0], BLOB))

    def broken(fd: int, size: int, limit: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk, "read_bounded", broken)
    with pytest.raises(TierError, match="Input/output error"):
        bounded(lambda: tier.get(KEYS[0]))
    assert counts["unsafe_files"] == 0 and tier.path_for(KEYS[0]).exists()


def test_planted_fifos_do_not_occupy_the_default_executor(tmp_path) -> None:
    tier, counts = make_tier(tmp_path / "root")
    for key in KEYS[:8]:
        os.mkfifo(plant(tier, key))

    async def go() -> tuple[list[bytes | None], set[str]]:
        loop = asyncio.get_running_loop()
        default = ThreadPoolExecutor(max_workers=1)
        loop.set_default_executor(default)
        held, release = threading.Event(), threading.Event()
        blocker = loop.run_in_executor(None, lambda: (held.set(), release.wait(10)))
        held.wait(5)
        try:  # the default executor's only thread is busy: the tier's reads must not need it
            values = await asyncio.wait_for(asyncio.gather(*(tier.get(k) for k in KEYS[:8])), 2.0)
        finally:
            release.set()
            await blocker
        # a disk that hangs every read fills the tier's own pool; the default executor still serves at once
        stuck, names = threading.Event(), set()
        slow_read = tier._read

        def hanging(where: Any) -> Any:
            names.add(threading.current_thread().name)
            stuck.wait(10)
            return slow_read(where)

        tier._read = hanging  # type: ignore[method-assign]
        reads = asyncio.gather(*(tier.get(k) for k in KEYS[8:16]))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        assert await asyncio.wait_for(loop.run_in_executor(None, lambda: 42), 1.0) == 42
        assert time.monotonic() - t0 < 0.5
        stuck.set()
        await asyncio.wait_for(reads, 5.0)
        default.shutdown(wait=False)
        return values, names

    values, names = bounded(go, timeout=20.0)
    assert values == [None] * 8 and counts["unsafe_files"] == 8
    assert names and all(n.startswith("scd-store-disk") for n in names)


def test_writes_are_private_and_never_through_a_link(tmp_path) -> None:
    tier, _ = make_tier(tmp_path / "root")
    bounded(lambda: tier.put(KEYS[0], BLOB))
    path = tier.path_for(KEYS[0])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for folder in path.parents[:3]:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    target = tmp_path / "target"
    target.write_bytes(b"keep me")
    path.unlink()
    path.symlink_to(target)  # a put over a link replaces the link, never writes its target
    bounded(lambda: tier.put(KEYS[0], b"new"))
    assert not path.is_symlink() and path.read_bytes() == b"new" and target.read_bytes() == b"keep me"


def test_a_closed_tier_is_a_tier_error(tmp_path) -> None:
    tier, _ = make_tier(tmp_path / "root")

    async def go() -> None:
        await tier.start()
        await tier.close()
        await tier.get(KEYS[0])

    with pytest.raises(TierError, match="closed"):
        bounded(go)
