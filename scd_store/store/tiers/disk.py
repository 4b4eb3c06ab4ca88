"""The disk tier: one file per blob at ``root/<space_id>/<generation>/<hash[:2]>/<hash>.scdb``, byte-bounded, LRU.

Writes go to a temp file of their own (``O_EXCL|O_NOFOLLOW``, 0600) renamed into place. Processes sharing the
root find each other's blobs (a key missing from the index is looked up on disk; hits set the mtime); the index
is rebuilt on start and every ``rescan_s``, the byte bound kept over all found; temp files go once their writer
is gone or they are an hour old. Bytes on disk are hostile until the read path verifies them, and the tier never
follows a link, blocks on what it opens or reads past its bound: the root is private, every path is opened from
an fd of the root with ``O_NOFOLLOW``, only regular files of at most ``max_value_bytes`` are read or indexed;
anything else where a directory or blob belongs (a symlink at any level, FIFO, socket, device, directory, a file
too large) is a miss: removed, counted (``unsafe_files``), logged once per tier. All disk I/O runs on the tier's
own thread pool, never the event loop's default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import stat
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from scd_store.store.fs_safety import check_owner_only, private_dir
from scd_store.store.keys import KeyError_, make_key, parse_key
from scd_store.store.pids import pid_alive
from scd_store.store.tiers.base import Tier, TierError, TierUsage

log = logging.getLogger("scd_store.store")

SUFFIX = ".scdb"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 3600.0
DEPTH = 3  # space_id / generation / hash[:2]
POOL_WORKERS = 4
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# what opening a link, a non-directory, a socket or a device with those flags answers: unsafe, not an I/O error
_UNSAFE_ERRNOS = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO, errno.ENODEV})
_READ_CHUNK = 64 << 10

T = TypeVar("T")
Where = tuple[tuple[str, str, str], str]  # (directories below the root, file name)
Drop = Callable[[int, str, str, str], None]  # (dir fd, name, entry, why): remove an unsafe entry, count and log it


def stale_temp_file(name: str, mtime: float, now: float) -> bool:
    """Whether a temp file (``<blob>.<pid>.<uuid>.tmp``) is left over: its writer is gone, or it is old."""
    parts = name.split(".")
    return now - mtime > STALE_TMP_S or (len(parts) >= 4 and parts[-3].isdigit() and not pid_alive(int(parts[-3])))


def remove_entry(dir_fd: int, name: str) -> None:
    """Remove ``name`` in ``dir_fd`` whatever it is (unlink never follows a link; a directory goes whole)."""
    with contextlib.suppress(OSError):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except (IsADirectoryError, PermissionError):
            shutil.rmtree(name, ignore_errors=True, dir_fd=dir_fd)  # fd-based: it follows no link either


def refusal(st: os.stat_result, limit: int) -> str | None:
    """Why an entry is no blob to read (None: a regular file of at most ``limit`` bytes)."""
    return (f"not a regular file (mode {st.st_mode:o})" if not stat.S_ISREG(st.st_mode) else
            f"{st.st_size} bytes, over the bound of {limit}" if st.st_size > limit else None)


def read_bounded(fd: int, size: int, limit: int) -> bytes | None:
    """At most ``limit + 1`` bytes of ``fd`` (``size``: what fstat said); None when it holds more than ``limit``."""
    parts: list[bytes] = []
    total, ask = 0, min(size, limit) + 1
    while total <= limit and (chunk := os.read(fd, ask)):
        parts.append(chunk)
        total += len(chunk)
        ask = min(_READ_CHUNK, limit + 1 - total)
    return None if total > limit else parts[0] if len(parts) == 1 else b"".join(parts)


def scan(root_fd: int, limit: int, drop: Drop) -> list[tuple[float, str, int]]:
    """``(mtime, key, size)`` of the blobs below ``root_fd`` (lstat: regular files of at most ``limit`` bytes); leftover
    temp files are removed, and what else lies where a directory or blob belongs is handed to ``drop``."""
    found: list[tuple[float, str, int]] = []
    now = time.time()
    for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=root_fd):
        parts = dirpath.split(os.sep)[1:]
        for name in list(dirnames):
            with contextlib.suppress(OSError):
                is_dir = stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
                if len(parts) < DEPTH and is_dir:
                    continue
                dirnames.remove(name)  # a link where a directory of ours should be, or below our depth
                if len(parts) < DEPTH or name.endswith(SUFFIX):
                    drop(dfd, name, os.path.join(dirpath, name), "a directory" if is_dir else "a link to a directory")
        for fname in filenames if len(parts) == DEPTH else ():
            try:
                st = os.stat(fname, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if fname.endswith(TMP_SUFFIX):
                if stale_temp_file(fname, st.st_mtime, now):
                    with contextlib.suppress(OSError):
                        os.unlink(fname, dir_fd=dfd)
            elif fname.endswith(SUFFIX) and (why := refusal(st, limit)) is not None:
                drop(dfd, fname, os.path.join(dirpath, fname), why)
            elif fname.endswith(SUFFIX) and fname[:2] == parts[2]:
                with contextlib.suppress(KeyError_):  # a name no key of ours makes: not a blob of ours
                    found.append((st.st_mtime, make_key(parts[0], parts[1], fname[:-len(SUFFIX)]), st.st_size))
    found.sort()
    return found


class DiskTier(Tier):
    """Byte-bounded files on a local disk, read and written without following links, on a pool of its own."""

    kind = "disk"

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, *, fsync: bool = False,
                 rescan_s: float | None = 60.0, max_value_bytes: int | None = 64 << 20,
                 name: str | None = None) -> None:
        super().__init__(name)
        for what, bound in (("max_bytes", max_bytes), ("rescan_s", rescan_s), ("max_value_bytes", max_value_bytes)):
            if bound is not None and bound <= 0:
                raise ValueError(f"disk tier {what} must be > 0 (rescan_s, max_value_bytes: or None), got {bound}")
        self.root = private_dir(root, "the disk tier root")
        self.max_bytes = max_bytes
        self.max_value_bytes: int = max_bytes if max_value_bytes is None else min(max_value_bytes, max_bytes)
        self.fsync = fsync
        self.rescan_s = rescan_s
        self._index: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._rescan_task: asyncio.Task[None] | None = None
        self._unsafe = self._incidents(log)  # unsafe entries: every one counted, the first one logged
        self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # closed once no job may use it
        self._close_root = weakref.finalize(self, os.close, self._root_fd)
        check_owner_only(self.root, os.fstat(self._root_fd), "the disk tier root")  # the directory held is checked
        self._pool = ThreadPoolExecutor(max_workers=POOL_WORKERS, thread_name_prefix="scd-store-disk")
        weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        self._lock, self._jobs, self._closed = threading.Lock(), 0, False  # jobs: submitted, not yet done

    def path_for(self, key: str) -> Path:
        (space_id, generation, prefix), fname = self._where(key)
        return self.root / space_id / generation / prefix / fname

    @staticmethod
    def _where(key: str) -> Where:
        space_id, generation, hex_ = parse_key(key)
        return (space_id, generation, hex_[:2]), f"{hex_}{SUFFIX}"

    async def start(self) -> None:
        await self._rescan()
        if self.rescan_s is not None:
            self._rescan_task = asyncio.ensure_future(self._rescan_loop())

    async def close(self) -> None:
        if self._rescan_task is not None:
            self._rescan_task.cancel()
            await asyncio.gather(self._rescan_task, return_exceptions=True)
            self._rescan_task = None
        with self._lock:
            self._closed, idle = True, not self._jobs
        self._pool.shutdown(wait=False, cancel_futures=True)  # what has not started is cancelled (and done)
        if idle:
            self._close_root()

    def rebuild_index(self) -> None:
        """Index every blob file by mtime, delete leftovers and unsafe entries (on this thread; start: the pool)."""
        if self._closed:
            raise TierError(f"disk tier {self.root} is closed")
        self._remove_keys(self._adopt(scan(self._root_fd, self.max_value_bytes, self._drop)))

    async def _rescan(self) -> None:
        found = await self._io("scan", scan, self._root_fd, self.max_value_bytes, self._drop)
        await self._io("evict", self._remove_keys, self._adopt(found))

    def _adopt(self, found: list[tuple[float, str, int]]) -> list[str]:
        self._index = OrderedDict((key, size) for _, key, size in found)
        self._bytes = sum(self._index.values())
        return self._evict_to(self.max_bytes)

    async def _rescan_loop(self) -> None:
        while self.rescan_s is not None:
            await asyncio.sleep(self.rescan_s)
            with contextlib.suppress(TierError):
                await self._rescan()

    # ----------------------------------------------------------------- the index (event loop only)
    def _evict_to(self, limit: int) -> list[str]:
        """Drop least recently used keys down to ``limit``; returns them (the caller removes their files)."""
        victims: list[str] = []
        while self._bytes > limit and self._index:
            victim, size = self._index.popitem(last=False)
            self._bytes -= size
            victims.append(victim)
            self._evicted(victim, size)
        return victims

    def _forget(self, key: str) -> None:
        self._bytes -= self._index.pop(key, 0)

    async def _hold(self, items: Sequence[tuple[str, int]]) -> None:
        """Index ``(key, size)`` pairs as most recently used, then keep the byte bound."""
        for key, size in items:
            self._forget(key)
            self._index[key] = size
            self._bytes += size
        victims = self._evict_to(self.max_bytes)
        if victims:
            await self._io("evict", self._remove_keys, victims)

    async def get(self, key: str) -> bytes | None:
        data = await self._io(f"read {key}", self._read, self._where(key))
        if data is None:  # absent (another process evicted it) or unsafe (removed)
            self._forget(key)
            return None
        await self._hold([(key, len(data))])
        return data

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return list(await asyncio.gather(*(self.get(k) for k in keys)))

    async def put(self, key: str, value: bytes) -> None:
        if len(value) > self.max_value_bytes:  # the store counts and skips these before; nothing is stored
            return
        await self._io(f"write {key}", self._write, self._where(key), value)
        await self._hold([(key, len(value))])

    async def contains(self, key: str) -> bool:
        return (await self.contains_many([key]))[0]

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Indexed, or on disk as a safe blob (another process wrote it): then it is indexed now."""
        missing = [k for k in dict.fromkeys(keys) if k not in self._index]
        if missing:
            sizes = await self._io("lookup", self._probe_many, [self._where(k) for k in missing])
            await self._hold([(k, s) for k, s in zip(missing, sizes, strict=True) if s is not None])
        return [k in self._index for k in keys]

    async def delete(self, key: str) -> bool:
        where, present = self._where(key), key in self._index
        self._forget(key)
        return await self._io(f"delete {key}", self._remove, where) or present

    def usage(self) -> TierUsage:
        return TierUsage(len(self._index), self._bytes, self.max_bytes)

    # ----------------------------------------------------------------- I/O (on the tier's pool only)
    async def _io(self, what: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the tier's own pool; an I/O error is a :class:`TierError`."""
        with self._lock:
            if self._closed:
                raise TierError(f"disk tier {self.root} is closed")
            self._jobs += 1
            job = self._pool.submit(fn, *args)
        job.add_done_callback(self._job_done)
        try:
            return await asyncio.wrap_future(job)
        except OSError as exc:
            raise TierError(f"disk tier {what} under {self.root}: {exc}") from exc

    def _job_done(self, _: object) -> None:
        with self._lock:
            self._jobs -= 1
            last = self._closed and not self._jobs
        if last:
            self._close_root()

    def _drop(self, dir_fd: int, name: str, entry: str, why: str) -> None:
        """Remove an entry that is no safe blob or directory, and count it; the first one is logged."""
        remove_entry(dir_fd, name)
        self._unsafe.count("unsafe_files", "disk tier %s: removed %s under %s (%s): a miss; further such entries "
                           "are counted (unsafe_files), not logged", self.name, entry, self.root, why)

    @contextlib.contextmanager
    def _dirs(self, dirs: Sequence[str], *, create: bool = False) -> Iterator[int | None]:
        """An fd of ``root/dirs...`` following no link; None: one is missing or unsafe (dropped; ``create`` remakes)."""
        fds: list[int] = []
        try:
            for i, name in enumerate(dirs):
                parent = fds[-1] if fds else self._root_fd
                for _ in range(2 if create else 1):
                    if create:
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(name, 0o700, dir_fd=parent)
                    try:
                        fds.append(os.open(name, _DIR_FLAGS, dir_fd=parent))
                        break
                    except OSError as exc:
                        if exc.errno in _UNSAFE_ERRNOS:
                            self._drop(parent, name, os.path.join(*dirs[:i + 1]), "not a directory (a symlink?)")
                        elif exc.errno != errno.ENOENT:
                            raise
                if len(fds) <= i:  # not opened
                    break
            yield fds[-1] if len(fds) == len(dirs) else None
        finally:
            for fd in fds:
                os.close(fd)

    def _leaf(self, dfd: int, fname: str, entry: str) -> os.stat_result | None:
        """lstat of a blob entry: None when absent, or no regular file within the bound (then removed, reported)."""
        try:
            st = os.stat(fname, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if (why := refusal(st, self.max_value_bytes)) is None:
            return st
        self._drop(dfd, fname, entry, why)
        return None

    def _read(self, where: Where) -> bytes | None:
        """The blob at ``where``: None when absent or unsafe (then removed and reported)."""
        (dirs, fname), limit = where, self.max_value_bytes
        entry = os.path.join(*dirs, fname)
        with self._dirs(dirs) as dfd:
            if dfd is None or self._leaf(dfd, fname, entry) is None:  # refused before anything is opened
                return None
            try:
                fd = os.open(fname, _FILE_FLAGS, dir_fd=dfd)
            except OSError as exc:  # gone or leased (a plain miss), swapped for no regular file since the lstat
                if exc.errno in _UNSAFE_ERRNOS:
                    self._drop(dfd, fname, entry, "no regular file (swapped in while opened)")
                elif exc.errno not in (errno.ENOENT, errno.EWOULDBLOCK):
                    raise
                return None
            try:
                st = os.fstat(fd)  # what was opened, which a swap after the lstat may have changed
                data = read_bounded(fd, st.st_size, limit) if (why := refusal(st, limit)) is None else None
                if data is None:
                    self._drop(dfd, fname, entry, why or "grew past the bound")
                    return None
                with contextlib.suppress(OSError):
                    os.utime(fd)  # recency every process sees
                return data
            finally:
                os.close(fd)

    def _probe_many(self, wheres: Sequence[Where]) -> list[int | None]:
        """Per entry: its size when it is a safe blob, else None (unsafe ones removed and reported)."""
        sizes: list[int | None] = []
        for dirs, fname in wheres:
            with self._dirs(dirs) as dfd:
                st = None if dfd is None else self._leaf(dfd, fname, os.path.join(*dirs, fname))
                sizes.append(None if st is None else st.st_size)
        return sizes

    def _write(self, where: Where, value: bytes) -> None:
        """Write ``value`` to a fresh temp file (never through a link) and rename it into place."""
        dirs, fname = where
        with self._dirs(dirs, create=True) as dfd:
            if dfd is None:
                raise OSError(errno.ENOTDIR, "cannot make the blob directory", os.path.join(*dirs))
            self._leaf(dfd, fname, os.path.join(*dirs, fname))  # a directory (or the like) where it goes: removed
            tmp = f"{fname}.{os.getpid()}.{uuid.uuid4().hex}{TMP_SUFFIX}"
            try:
                fd = os.open(tmp, _TMP_FLAGS, 0o600, dir_fd=dfd)
                try:
                    view = memoryview(value)
                    while view:
                        view = view[os.write(fd, view):]
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, fname, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise

    def _remove(self, where: Where) -> bool:
        """Unlink the entry at ``where``; True when there was one."""
        dirs, fname = where
        with self._dirs(dirs) as dfd:
            if dfd is None or self._leaf(dfd, fname, os.path.join(*dirs, fname)) is None:  # unsafe: removed
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(fname, dir_fd=dfd)
                return True
            return False

    def _remove_keys(self, keys: Sequence[str]) -> None:
        for key in keys:
            with contextlib.suppress(OSError):
                self._remove(self._where(key))

