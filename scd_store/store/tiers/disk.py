"""The disk tier: one file per blob under a root directory, byte-bounded with LRU eviction.

Files live at ``root/<space_id>/<hash[:2]>/<hash>.scdb``. Writes go to a unique temp file in the
same directory and are renamed into place, so a reader sees the old file, the new file or none,
never half a file. On start the index is rebuilt from the directory (least recently modified
first) and stale temp files are removed.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections import OrderedDict
from pathlib import Path

import aiofiles
import aiofiles.os

from scd_store.store.keys import parse_key
from scd_store.store.tiers.base import Tier, TierError, TierUsage

SUFFIX = ".scdb"
TMP_SUFFIX = ".tmp"


class DiskTier(Tier):
    """Byte-bounded files on a local disk (aiofiles for the I/O)."""

    kind = "disk"

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, *, fsync: bool = False,
                 name: str | None = None) -> None:
        super().__init__(name)
        if max_bytes <= 0:
            raise ValueError(f"disk tier max_bytes must be > 0, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self._index: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._started = False

    def path_for(self, key: str) -> Path:
        space_id, hex_ = parse_key(key)
        return self.root / space_id / hex_[:2] / f"{hex_}{SUFFIX}"

    async def start(self) -> None:
        self.rebuild_index()
        self._started = True

    def rebuild_index(self) -> None:
        """Scan the directory: index every blob file by mtime, delete leftover temp files."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierError(f"disk tier cannot create {self.root}: {exc}") from exc
        found: list[tuple[float, str, int]] = []
        for dirpath, _, files in os.walk(self.root):
            for fname in files:
                path = os.path.join(dirpath, fname)
                if fname.endswith(TMP_SUFFIX):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    continue
                if not fname.endswith(SUFFIX):
                    continue
                space_id = os.path.basename(os.path.dirname(dirpath))
                key = f"scd:{space_id}:{fname[:-len(SUFFIX)]}"
                try:
                    parse_key(key)
                    st = os.stat(path)
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort()
        self._index = OrderedDict((key, size) for _, key, size in found)
        self._bytes = sum(self._index.values())
        self._evict_to(self.max_bytes)

    def _evict_to(self, limit: int) -> None:
        while self._bytes > limit and self._index:
            victim, size = self._index.popitem(last=False)
            self._bytes -= size
            with contextlib.suppress(OSError):
                os.unlink(self.path_for(victim))
            self._evicted(victim, size)

    async def get(self, key: str) -> bytes | None:
        if key not in self._index:
            return None
        path = self.path_for(key)
        try:
            async with aiofiles.open(path, "rb") as f:
                data = await f.read()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as exc:
            raise TierError(f"disk tier read {path}: {exc}") from exc
        self._index.move_to_end(key)
        return data

    async def put(self, key: str, value: bytes) -> None:
        size = len(value)
        if size > self.max_bytes:
            return
        path = self.path_for(key)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}{TMP_SUFFIX}")
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
        return key in self._index

    async def contains_many(self, keys: list[str]) -> list[bool]:  # type: ignore[override]
        index = self._index
        return [k in index for k in keys]

    async def delete(self, key: str) -> bool:
        present = key in self._index
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

