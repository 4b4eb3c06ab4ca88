"""The peer tier: code blobs in other processes' registered memory, read over NIXL.

A process whose peer tier has ``publish_bytes`` keeps what it stores in a registered arena (its
:class:`BlobSource`) and records where each blob sits in a :class:`PeerDirectory`; any process's
peer tier locates blobs there and reads each source's share of a batch in one NIXL READ (one
in-process copy without NIXL). A read that fails or times out is a miss; a stale location (the
source's arena wrapped, or the source is gone) reads other bytes or none, which the store's blob
verification turns into a miss. Readers never delete another process's blobs: a delete only drops
this process's view of the location.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence

from scd_store.store.tiers.base import Tier, TierUsage
from scd_store.store.transfer.base import BlobReader, BlobSource
from scd_store.store.transfer.directory import PeerDirectory, group_by_source
from scd_store.store.transfer.factory import make_reader, make_source

log = logging.getLogger("scd_store.store")


class PeerTier(Tier):
    """Blobs in peers' registered memory (and, with ``publish_bytes``, in this process's)."""

    kind = "peer"
    shared = True

    def __init__(self, directory: PeerDirectory, *, publish_bytes: int = 0, transfer: str = "auto",
                 read_timeout_s: float = 1.0, name: str | None = None) -> None:
        super().__init__(name)
        if publish_bytes < 0 or read_timeout_s <= 0:
            raise ValueError("publish_bytes must be >= 0 and read_timeout_s > 0")
        self.directory = directory
        self.publish_bytes = publish_bytes
        self.max_value_bytes = publish_bytes or None
        self.transfer = transfer
        self.read_timeout_s = read_timeout_s
        self.source: BlobSource | None = None
        self.reader: BlobReader | None = None
        self._connected: set[str] = set()
        self._lock = threading.Lock()  # the reader's buffers are not for two transfers at once

    async def start(self) -> None:
        self.reader = make_reader(kind=self.transfer)
        if self.publish_bytes:
            self.source = make_source(self.publish_bytes, kind=self.transfer)
            self.directory.add_source(self.source.info())

    async def close(self) -> None:
        for part in (self.reader, self.source):
            if part is not None:
                part.close()
        self.directory.close()

    # ----------------------------------------------------------------- writes
    async def put(self, key: str, value: bytes) -> None:
        await self.put_many([(key, value)])

    async def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        if self.source is None or not items:
            return  # a read-only peer tier holds nothing of its own
        refs = self.source.publish(dict(items))
        self.directory.record(self.source.info().name, refs)

    # ----------------------------------------------------------------- reads
    async def get(self, key: str) -> bytes | None:
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return await asyncio.to_thread(self._read, list(keys))

    def _read(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        assert self.reader is not None, "the peer tier is not started"
        for source, entries in group_by_source(self.directory.locate(keys)).items():
            with self._lock:
                if source not in self._connected:
                    info = self.directory.source(source)
                    if info is None:
                        continue
                    try:
                        self.reader.connect(info)
                    except Exception as exc:  # a peer we cannot reach is a miss
                        log.info("peer tier: cannot connect to %s (%s): miss", source, exc)
                        continue
                    self._connected.add(source)
                blobs = self.reader.read(source, [ref for _, ref in entries], timeout_s=self.read_timeout_s)
            for (i, _), blob in zip(entries, blobs, strict=True):
                out[i] = blob
        return out

    async def contains(self, key: str) -> bool:
        return (await self.contains_many([key]))[0]

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [location is not None for location in await asyncio.to_thread(self.directory.locate, list(keys))]

    async def delete(self, key: str) -> bool:
        await self.delete_many([key])
        return True

    async def delete_many(self, keys: Sequence[str]) -> int:
        self.directory.forget(list(keys))
        return len(keys)

    def usage(self) -> TierUsage:
        return TierUsage(0, 0, self.publish_bytes or None)
