"""The disk tier: one file per blob under a root directory, byte-bounded with LRU eviction.

Files live at ``root/<space_id>/<generation>/<hash[:2]>/<hash>.scdb``. Writes go to a unique temp file in the
same directory (named with the writer's pid) and are renamed into place, so a reader sees the old
file, the new file or none, never half a file.

Several processes on one host may share one directory (the embedded default): a key missing from
this process's index is looked up on disk, so blobs another process wrote are found; a hit sets
the file's mtime, so recency is shared. The index is rebuilt from the directory on start and every
``rescan_s`` (least recently used first), and the byte bound is enforced over everything found,
so the directory stays within ``max_bytes`` across processes (between rescans, each process adds
only what it writes or finds). Temp files are removed only when their writer is gone or they are
older than an hour: never another live process's write in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import aiofiles
import aiofiles.os

from scd_store.store.keys import parse_key
from scd_store.store.pids import pid_alive
from scd_store.store.tiers.base import Tier, TierError, TierUsage

SUFFIX = ".scdb"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 3600.0


def stale_temp_file(name: str, mtime: float, now: float) -> bool:
    """Whether a temp file (``<blob>.<pid>.<uuid>.tmp``) is left over: its writer is gone, or it is old."""
    if now - mtime > STALE_TMP_S:
        return True
    parts = name.split(".")
    return len(parts) >= 4 and parts[-3].isdigit() and not pid_alive(int(parts[-3]))


def scan(root: Path) -> list[tuple[float, str, int]]:
    """``(mtime, key, size)`` of every blob file under ``root``; leftover temp files are removed."""
    found: list[tuple[float, str, int]] = []
    now = time.time()
    for dirpath, _, files in os.walk(root):
        for fname in files:
            path = os.path.join(dirpath, fname)
            try:
                st = os.stat(path)
            except OSError:
                continue
            if fname.endswith(TMP_SUFFIX):
                if stale_temp_file(fname, st.st_mtime, now):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                continue
            if not fname.endswith(SUFFIX):
                continue
            generation_dir = os.path.dirname(dirpath)
            space_id, generation = os.path.basename(os.path.dirname(generation_dir)), os.path.basename(generation_dir)
            key = f"scd:{space_id}:{generation}:{fname[:-len(SUFFIX)]}"
            try:
                parse_key(key)
            except ValueError:
                continue
            found.append((st.st_mtime, key, st.st_size))
    found.sort()
    return found


class DiskTier(Tier):
    """Byte-bounded files on a local disk (aiofiles for the I/O)."""

    kind = "disk"

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, *, fsync: bool = False,
                 rescan_s: float | None = 60.0, name: str | None = None) -> None:
        super().__init__(name)
        if max_bytes <= 0:
            raise ValueError(f"disk tier max_bytes must be > 0, got {max_bytes}")
        if rescan_s is not None and rescan_s <= 0:
            raise ValueError(f"disk tier rescan_s must be > 0 (or None: never), got {rescan_s}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.rescan_s = rescan_s
        self._index: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._started = False
        self._rescan_task: asyncio.Task[None] | None = None

    def path_for(self, key: str) -> Path:
        space_id, generation, hex_ = parse_key(key)
        return self.root / space_id / generation / hex_[:2] / f"{hex_}{SUFFIX}"

    async def start(self) -> None:
        self.rebuild_index()
        self._started = True
        if self.rescan_s is not None:
            self._rescan_task = asyncio.ensure_future(self._rescan_loop())

    async def close(self) -> None:
        if self._rescan_task is not None:
            self._rescan_task.cancel()
            await asyncio.gather(self._rescan_task, return_exceptions=True)
            self._rescan_task = None

    def rebuild_index(self) -> None:
        """Scan the directory: index every blob file by mtime, delete leftover temp files."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierError(f"disk tier cannot create {self.root}: {exc}") from exc
        self._adopt(scan(self.root))

    def _adopt(self, found: list[tuple[float, str, int]]) -> None:
        self._index = OrderedDict((key, size) for _, key, size in found)
        self._bytes = sum(self._index.values())
        self._evict_to(self.max_bytes)

    async def _rescan_loop(self) -> None:
        assert self.rescan_s is not None
        while True:
            await asyncio.sleep(self.rescan_s)
            with contextlib.suppress(OSError):
                self._adopt(await asyncio.to_thread(scan, self.root))

    def _find(self, key: str) -> bool:
        """Whether ``key`` is indexed, or on disk (another process wrote it): then it is indexed now."""
        if key in self._index:
            return True
        try:
            size = os.stat(self.path_for(key)).st_size
        except OSError:
            return False
        self._index[key] = size
        self._bytes += size
        self._evict_to(self.max_bytes)
        return key in self._index

    def _evict_to(self, limit: int) -> None:
        while self._bytes > limit and self._index:
            victim, size = self._index.popitem(last=False)
            self._bytes -= size
            with contextlib.suppress(OSError):
                os.unlink(self.path_for(victim))
            self._evicted(victim, size)

    async def get(self, key: str) -> bytes | None:
        if not self._find(key):
            return None
        path = self.path_for(key)
        try:
            async with aiofiles.open(path, "rb") as f:
                data = await f.read()
        except FileNotFoundError:  # another process evicted it
            self._forget(key)
            return None
        except OSError as exc:
            raise TierError(f"disk tier read {path}: {exc}") from exc
        self._index.move_to_end(key)
        with contextlib.suppress(OSError):
            os.utime(path)  # recency every process sees
        return data

    async def put(self, key: str, value: bytes) -> None:
        size = len(value)
        if size > self.max_bytes:
            return
        path = self.path_for(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}{TMP_SUFFIX}")
        try:
            await aiofiles.os.makedirs(path.parent, exist_ok=True)
            async with aiofiles.open(tmp, "wb") as f:
                await f.write(value)
                if self.fsync:
                    await f.flush()
                    await aiofiles.os.wrap(os.fsync)(f.fileno())
            await aiofiles.os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise TierError(f"disk tier write {path}: {exc}") from exc
        self._forget(key)
        self._index[key] = size
        self._bytes += size
        self._evict_to(self.max_bytes)

    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size

    async def contains(self, key: str) -> bool:
        return self._find(key)

    async def contains_many(self, keys: list[str]) -> list[bool]:  # type: ignore[override]
        index = self._index
        return [k in index or self._find(k) for k in keys]

    async def delete(self, key: str) -> bool:
        present = self._find(key)
        self._forget(key)
        try:
            await aiofiles.os.remove(self.path_for(key))
        except FileNotFoundError:
            return present
        except OSError as exc:
            raise TierError(f"disk tier delete {key}: {exc}") from exc
        return True

    def usage(self) -> TierUsage:
        return TierUsage(len(self._index), self._bytes, self.max_bytes)

