"""Where-is-what for the peer tier: which process's registered memory holds which blob.

A process that publishes blobs (a :class:`~scd_store.store.transfer.base.BlobSource`) records its
:class:`SourceInfo` once and a :class:`~scd_store.store.transfer.entry.LocationEntry` per blob
(source, offset, length, the SHA-256 of the source's info, signed by the blob's space producer);
readers look entries up, verify them (:mod:`scd_store.store.tiers.peer`) and connect to the sources
they need. Two backends:

- :class:`RedisPeerDirectory`: hashes ``scd:__peer__:sources`` and ``scd:__peer__:loc`` (between hosts);
- :class:`FilePeerDirectory`: one host; per source ``<name>.info`` and an append-only
  ``<name>.jsonl`` of entries that readers follow incrementally.

Whoever can write the directory can write anything there: the directory only parses (strictly,
with bounded reads: a malformed entry is None, never an exception); trusting an entry is the
reader's job. A location may also be stale (the source's arena wrapped, or the source is gone): the
read then returns other bytes or nothing, which the blob verification turns into a miss.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import stat
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scd_store.store.fs_safety import private_dir
from scd_store.store.transfer.base import (
    MAX_INFO_BYTES,
    BlobRef,
    SourceInfo,
    TransferError,
    strict_json,
    valid_source_name,
)
from scd_store.store.transfer.entry import MAX_ENTRY_BYTES, LocationEntry, entry_from_list, parse_entry

Location = tuple[str, BlobRef]  # (source name, where in its region)
SOURCES, LOCATIONS = "scd:__peer__:sources", "scd:__peer__:loc"
MAX_FOLLOW_BYTES = 16 << 20  # read from one source's log per lookup (the rest waits for the next)
MAX_LOG_LINE = MAX_ENTRY_BYTES + 1024  # an entry plus its key


class PeerDirectory(ABC):
    """Sources and blob entries shared by the processes of a deployment. :meth:`forget` is this
    process's own: it hides an entry that proved bad here, until the blob is published anew."""

    def __init__(self) -> None:
        self._forgotten: dict[str, LocationEntry] = {}
        self._forget_lock = threading.Lock()
        self._malformed = 0

    def take_malformed(self) -> int:
        """How many entries the directory held that did not parse since the last call (each was a miss)."""
        with self._forget_lock:
            n, self._malformed = self._malformed, 0
        return n

    def _count_malformed(self, n: int) -> None:
        if n:
            with self._forget_lock:
                self._malformed += n

    @abstractmethod
    def add_source(self, info: SourceInfo) -> None:
        """Publish a source's info (``info.to_bytes()``, which entries' ``info_digest`` hashes)."""

    @abstractmethod
    def source_bytes(self, name: str) -> bytes | None:
        """The serialised info of source ``name`` as stored (None: absent, or too large to be one)."""

    def source(self, name: str) -> SourceInfo | None:
        """The parsed info of source ``name``; None when absent or malformed."""
        raw = self.source_bytes(name)
        try:
            return None if raw is None else SourceInfo.from_bytes(raw)
        except TransferError:
            return None

    @abstractmethod
    def record_entries(self, entries: Sequence[LocationEntry]) -> None:
        """Publish the entries of blobs (each replaces its key's earlier one)."""

    def record(self, source: str, refs: Sequence[BlobRef], digest: str = "") -> None:
        """Publish unsigned entries of ``refs`` in ``source`` (for deployments without keys)."""
        self.record_entries([LocationEntry.make(r, source, digest, None) for r in refs])

    @abstractmethod
    def _entries(self, keys: Sequence[str]) -> list[LocationEntry | None]: ...

    def entries(self, keys: Sequence[str]) -> list[LocationEntry | None]:
        """Each key's entry as the directory holds it (unverified; None: none this process may use)."""
        found = self._entries(keys)
        with self._forget_lock:
            if not self._forgotten:
                return found
            return [None if e is not None and self._forgotten.get(k) == e else e
                    for k, e in zip(keys, found, strict=True)]

    def locate(self, keys: Sequence[str]) -> list[Location | None]:
        """Where each key's blob is, as the directory says (unverified)."""
        return [None if e is None else (e.source, e.ref) for e in self.entries(keys)]

    def forget(self, keys: Sequence[str]) -> None:
        """Hide the current entries of ``keys`` from this process."""
        current = self._entries(keys)
        with self._forget_lock:
            for key, entry in zip(keys, current, strict=True):
                if entry is not None:
                    self._forgotten[key] = entry

    def close(self) -> None:
        return None


class RedisPeerDirectory(PeerDirectory):
    """The directory in Redis (standalone, Sentinel or Cluster URLs, like the Redis tier)."""

    def __init__(self, url: str, client: Any = None) -> None:
        from scd_store.store.redis_url import make_sync_client

        super().__init__()
        self.client = client if client is not None else make_sync_client(url)

    def add_source(self, info: SourceInfo) -> None:
        self.client.hset(SOURCES, info.name, base64.b64encode(info.to_bytes()))

    def source_bytes(self, name: str) -> bytes | None:
        if not valid_source_name(name):
            return None
        if self.client.hstrlen(SOURCES, name) > 4 * (MAX_INFO_BYTES // 3 + 1):  # not read at all
            return None
        raw = self.client.hget(SOURCES, name)
        if raw is None or len(raw) > 4 * (MAX_INFO_BYTES // 3 + 1):
            return None
        try:
            return base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError, TypeError):
            return None

    def record_entries(self, entries: Sequence[LocationEntry]) -> None:
        if entries:
            self.client.hset(LOCATIONS, mapping={e.key: e.to_json() for e in entries})

    def _entries(self, keys: Sequence[str]) -> list[LocationEntry | None]:
        if not keys:
            return []
        raws = self.client.hmget(LOCATIONS, list(keys))
        found = [parse_entry(k, raw) for k, raw in zip(keys, raws, strict=True)]
        self._count_malformed(sum(raw is not None and e is None for raw, e in zip(raws, found, strict=True)))
        return found

    def close(self) -> None:
        self.client.close()


def _open_regular(path: Path) -> int | None:
    """A read-only descriptor of ``path`` when it is a regular file (no symlink, FIFO or device), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


class FilePeerDirectory(PeerDirectory):
    """The directory as files under ``root`` (the processes of one host); this process keeps up to
    ``max_entries`` entries it followed (the oldest are dropped: a miss)."""

    def __init__(self, root: str | os.PathLike[str], max_entries: int = 1 << 16) -> None:
        super().__init__()
        self.root = private_dir(root, "the peer directory")  # 0700: no other user plants links or logs here
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._locations: OrderedDict[str, LocationEntry] = OrderedDict()
        self._read_upto: dict[str, int] = {}  # source log -> bytes consumed

    def add_source(self, info: SourceInfo) -> None:
        tmp = self.root / f".{info.name}.{os.getpid()}.info.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(info.to_bytes())
        os.replace(tmp, self.root / f"{info.name}.info")

    def source_bytes(self, name: str) -> bytes | None:
        if not valid_source_name(name):
            return None
        fd = _open_regular(self.root / f"{name}.info")
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_INFO_BYTES + 1)
        return data if len(data) <= MAX_INFO_BYTES else None

    def record_entries(self, entries: Sequence[LocationEntry]) -> None:
        by_source: dict[str, list[LocationEntry]] = {}
        for e in entries:
            by_source.setdefault(e.source, []).append(e)
        for source, group in by_source.items():
            lines = "".join(json.dumps([e.key, *e.to_list()], separators=(",", ":")) + "\n" for e in group)
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(self.root / f"{source}.jsonl", flags, 0o600)  # never through a planted link
            with os.fdopen(fd, "a") as log:
                if not stat.S_ISREG(os.fstat(log.fileno()).st_mode):
                    raise OSError(f"peer directory log {source}.jsonl is no regular file")
                log.write(lines)  # one write: lines land whole

    def _read_new(self, path: Path, source: str) -> bytes:
        fd = _open_regular(path)
        if fd is None:
            return b""
        with os.fdopen(fd, "rb") as log:
            upto = self._read_upto.get(source, 0)
            if os.fstat(log.fileno()).st_size < upto:  # truncated or replaced: read it again
                upto = self._read_upto[source] = 0
            log.seek(upto)
            return log.read(MAX_FOLLOW_BYTES)

    def _follow(self) -> None:
        for path in self.root.glob("*.jsonl"):
            source = path.stem
            if not valid_source_name(source):
                continue
            try:
                data = self._read_new(path, source)
            except OSError:
                continue
            cut = data.rfind(b"\n") + 1
            if not cut and len(data) >= MAX_FOLLOW_BYTES:
                cut = len(data)  # no line end in a whole read: not an entry, skipped
            self._read_upto[source] = self._read_upto.get(source, 0) + cut  # a partial line waits
            for line in filter(None, data[:cut].splitlines()):
                entry = _log_entry(line, source)
                if entry is None:
                    self._count_malformed(1)
                    continue
                self._locations.pop(entry.key, None)
                self._locations[entry.key] = entry
            while len(self._locations) > self.max_entries:
                self._locations.popitem(last=False)

    def _entries(self, keys: Sequence[str]) -> list[LocationEntry | None]:
        with self._lock:
            if any(k not in self._locations or k in self._forgotten for k in keys):
                self._follow()  # new lines: new blobs, or a forgotten blob published anew
            return [self._locations.get(k) for k in keys]


def _log_entry(line: bytes, source: str) -> LocationEntry | None:
    """One log line ``[key, source, offset, length, digest, key_id, signature]`` of ``source``'s log, or None."""
    if len(line) > MAX_LOG_LINE:
        return None
    with contextlib.suppress(ValueError, TypeError, RecursionError, OverflowError):
        items = strict_json(line)
        if isinstance(items, list) and len(items) == 7 and items[1] == source:
            return entry_from_list(items[0], items[1:])
    return None


def directory_for(url: str | None, path: str | os.PathLike[str] | None) -> PeerDirectory:
    """Redis when ``url`` is given, else files under ``path``."""
    if url:
        return RedisPeerDirectory(url)
    if path is None:
        raise ValueError("a peer directory needs a Redis URL or a path")
    return FilePeerDirectory(path)
