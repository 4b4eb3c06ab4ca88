"""Where-is-what for the peer tier: which process's registered memory holds which blob.

A process that publishes blobs (a :class:`~scd_store.store.transfer.base.BlobSource`) records its
:class:`SourceInfo` once and a location ``(source, offset, length)`` per blob; readers look
locations up and connect to the sources they need. Two backends:

- :class:`RedisPeerDirectory`: hashes ``scd:__peer__:sources`` and ``scd:__peer__:loc`` (between hosts);
- :class:`FilePeerDirectory`: one host; per source ``<name>.info`` and an append-only
  ``<name>.jsonl`` of locations that readers follow incrementally.

A location may be stale (the source's arena wrapped, or the source is gone): the read then returns
other bytes or nothing, which the blob checksum or the transfer's failure turns into a miss.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scd_store.store.transfer.base import BlobRef, SourceInfo

Location = tuple[str, BlobRef]  # (source name, where in its region)
SOURCES, LOCATIONS = "scd:__peer__:sources", "scd:__peer__:loc"


class PeerDirectory(ABC):
    """Sources and blob locations shared by the processes of a deployment. :meth:`forget` is this
    process's own: it hides a location that proved bad here, until the blob is published anew."""

    def __init__(self) -> None:
        self._forgotten: dict[str, Location] = {}
        self._forget_lock = threading.Lock()

    @abstractmethod
    def add_source(self, info: SourceInfo) -> None: ...

    @abstractmethod
    def source(self, name: str) -> SourceInfo | None: ...

    @abstractmethod
    def record(self, source: str, refs: Sequence[BlobRef]) -> None: ...

    @abstractmethod
    def _locate(self, keys: Sequence[str]) -> list[Location | None]: ...

    def locate(self, keys: Sequence[str]) -> list[Location | None]:
        """Where each key's blob is (None: nowhere this process may read it)."""
        found = self._locate(keys)
        with self._forget_lock:
            if not self._forgotten:
                return found
            return [None if loc is not None and self._forgotten.get(k) == loc else loc
                    for k, loc in zip(keys, found, strict=True)]

    def forget(self, keys: Sequence[str]) -> None:
        """Hide the current locations of ``keys`` from this process."""
        current = self._locate(keys)
        with self._forget_lock:
            for key, loc in zip(keys, current, strict=True):
                if loc is not None:
                    self._forgotten[key] = loc

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

    def source(self, name: str) -> SourceInfo | None:
        raw = self.client.hget(SOURCES, name)
        return None if raw is None else SourceInfo.from_bytes(base64.b64decode(raw))

    def record(self, source: str, refs: Sequence[BlobRef]) -> None:
        if refs:
            self.client.hset(LOCATIONS, mapping={r.key: json.dumps([source, r.offset, r.length]) for r in refs})

    def _locate(self, keys: Sequence[str]) -> list[Location | None]:
        if not keys:
            return []
        return [_location(k, raw) for k, raw in zip(keys, self.client.hmget(LOCATIONS, list(keys)), strict=True)]

    def close(self) -> None:
        self.client.close()


def _location(key: str, raw: Any) -> Location | None:
    if raw is None:
        return None
    try:
        source, offset, length = json.loads(raw)
        return str(source), BlobRef(key, int(offset), int(length))
    except (ValueError, TypeError):
        return None


class FilePeerDirectory(PeerDirectory):
    """The directory as files under ``root`` (the processes of one host)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__()
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._locations: dict[str, Location] = {}
        self._read_upto: dict[str, int] = {}  # source log -> bytes consumed

    def add_source(self, info: SourceInfo) -> None:
        tmp = self.root / f".{info.name}.info.tmp"
        tmp.write_bytes(info.to_bytes())
        os.replace(tmp, self.root / f"{info.name}.info")

    def source(self, name: str) -> SourceInfo | None:
        try:
            return SourceInfo.from_bytes((self.root / f"{name}.info").read_bytes())
        except OSError:
            return None

    def record(self, source: str, refs: Sequence[BlobRef]) -> None:
        if not refs:
            return
        lines = "".join(json.dumps([r.key, r.offset, r.length]) + "\n" for r in refs)
        with open(self.root / f"{source}.jsonl", "a") as log:  # one write: lines land whole
            log.write(lines)

    def _follow(self) -> None:
        for path in self.root.glob("*.jsonl"):
            source = path.stem
            try:
                with open(path, "rb") as log:
                    log.seek(self._read_upto.get(source, 0))
                    data = log.read()
            except OSError:
                continue
            whole = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next call
            self._read_upto[source] = self._read_upto.get(source, 0) + len(whole)
            for line in whole.splitlines():
                try:
                    key, offset, length = json.loads(line)
                    self._locations[str(key)] = (source, BlobRef(str(key), int(offset), int(length)))
                except (ValueError, TypeError):
                    continue

    def _locate(self, keys: Sequence[str]) -> list[Location | None]:
        with self._lock:
            if any(k not in self._locations or k in self._forgotten for k in keys):
                self._follow()  # new lines: new blobs, or a forgotten blob published anew
            return [self._locations.get(k) for k in keys]


def directory_for(url: str | None, path: str | os.PathLike[str] | None) -> PeerDirectory:
    """Redis when ``url`` is given, else files under ``path``."""
    if url:
        return RedisPeerDirectory(url)
    if path is None:
        raise ValueError("a peer directory needs a Redis URL or a path")
    return FilePeerDirectory(path)


def group_by_source(locations: Sequence[Location | None]) -> Mapping[str, list[tuple[int, BlobRef]]]:
    """``source -> [(index in locations, ref), ...]`` of the located entries."""
    groups: dict[str, list[tuple[int, BlobRef]]] = {}
    for i, location in enumerate(locations):
        if location is not None:
            groups.setdefault(location[0], []).append((i, location[1]))
    return groups
