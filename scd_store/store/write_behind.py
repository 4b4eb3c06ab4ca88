"""The write-behind: bounded queues to every tier below the top, drained by background writers.

A put returns once the top tier holds its blobs; every lower tier gets them later (write-behind,
not write-through). A put offers its blobs to each lower tier's queue; a full queue blocks the
putting thread up to ``put_timeout_s`` (back-pressure). A blob a lower tier does not get (its queue
stayed full, the tier is down, the write failed) is counted in ``dropped_writes`` and its key is
remembered (up to ``resync_keys`` per tier): once the tier takes writes again, a re-sync reads those
blobs back from the top tier and writes them (``resynced_writes``). A blob that can no longer be
re-synced (forgotten past ``resync_keys``, gone from the top tier, or still pending at close) is
counted in ``lost_writes``, as are batches still being written when :meth:`stop` gives up (it drains
within a deadline and reports what it could not write). A blob larger than a tier's
``max_value_bytes`` is never offered to it (``oversized_writes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from scd_store.store.guard import TierGuard
from scd_store.store.keys import space_of
from scd_store.store.stats import StoreStats
from scd_store.store.tiers.base import Tier

log = logging.getLogger("scd_store.store")
Item = tuple[str, bytes]
Source = Callable[[list[str]], list[bytes | None]]  # blobs of keys from the tiers above (the top tier)
BATCH = 32


class WriteBehind:
    """Queues, writers and re-sync for ``tiers`` (the store's tiers below the top one)."""

    def __init__(self, tiers: Sequence[Tier], guard: TierGuard, stats: StoreStats, *, queue_sizes: Sequence[int],
                 writers: Sequence[int], put_timeout_s: float, source: Source | None = None,
                 resync_keys: int = 65536, resync_s: float = 0.25) -> None:
        if not len(tiers) == len(queue_sizes) == len(writers):
            raise ValueError("one queue size and one writer count per lower tier")
        self.tiers = list(tiers)
        self.guard = guard
        self.stats = stats
        self.put_timeout_s = put_timeout_s
        self.source = source
        self.resync_keys = resync_keys
        self.resync_s = resync_s
        self._queue_sizes = list(queue_sizes)
        self._writers = list(writers)
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._missed: dict[str, OrderedDict[str, None]] = {t.name: OrderedDict() for t in self.tiers}
        self._inflight: dict[str, dict[int, list[str]]] = {t.name: {} for t in self.tiers}  # batches being written
        self._tasks: list[asyncio.Task[None]] = []

    # ----------------------------------------------------------------- lifecycle (on the store's loop)
    async def start(self) -> None:
        """Create the queues and start the writers and re-syncs."""
        for tier, size, count in zip(self.tiers, self._queue_sizes, self._writers, strict=True):
            queue: asyncio.Queue[Item] = asyncio.Queue(size)
            self._queues[tier.name] = queue
            for _ in range(count):
                self._tasks.append(asyncio.ensure_future(self._writer(tier, queue)))
            if self.source is not None:
                self._tasks.append(asyncio.ensure_future(self._resync(tier)))

    async def join(self) -> None:
        """Until every queued blob has reached its tier (or failed)."""
        await asyncio.gather(*(q.join() for q in self._queues.values()))

    async def stop(self, timeout: float) -> dict[str, int]:
        """Drain for up to ``timeout`` s, stop the writers; returns, per tier, the blobs it did not get
        (still queued, or dropped and not re-synced), counted in ``lost_writes``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.join(), max(0.0, timeout))
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        unwritten: dict[str, int] = {}
        for name, queue in self._queues.items():
            keys = list(self._missed[name])
            for batch in self._inflight[name].values():  # cut off mid-write: not known to be there
                keys.extend(batch)
            while not queue.empty():
                keys.append(queue.get_nowait()[0])
            self._missed[name].clear()
            self._inflight[name].clear()
            if keys:
                unwritten[name] = len(keys)
                self._count("lost_writes", name, keys)
        return unwritten

    def pending(self) -> dict[str, int]:
        """Per tier: blobs queued plus dropped ones waiting for a re-sync."""
        return {name: q.qsize() + len(self._missed[name]) for name, q in self._queues.items()}

    # ----------------------------------------------------------------- offering blobs
    async def enqueue(self, items: list[Item], space_id: str) -> None:
        """Queue ``items`` for every lower tier, waiting up to ``put_timeout_s`` in all for room (not at
        all for a tier that is down: its blobs are remembered for the re-sync at once)."""
        deadline = time.monotonic() + self.put_timeout_s
        for tier in self.tiers:
            name, queue = tier.name, self._queues[tier.name]
            fits = self._fitting(tier, items, space_id)
            if self.guard.health[name].down:
                self._drop(name, [k for k, _ in fits])
                continue
            for n, item in enumerate(fits):
                try:
                    await asyncio.wait_for(queue.put(item), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    log.warning("store tier %s write queue full for %.1f s: %d blobs left for its re-sync", name,
                                self.put_timeout_s, len(fits) - n)
                    self._drop(name, [k for k, _ in fits[n:]])
                    break

    def _fitting(self, tier: Tier, items: list[Item], space_id: str) -> list[Item]:
        """The items ``tier`` takes; the rest are counted as ``oversized_writes`` (never owed to it)."""
        fits = [item for item in items if tier.accepts(len(item[1]))]
        if len(fits) < len(items):
            self.stats.inc("oversized_writes", len(items) - len(fits), tier=tier.name, space=space_id)
            log.debug("store tier %s: %d blobs over its max_value_bytes not written", tier.name,
                      len(items) - len(fits))
        return fits

    def offer_nowait(self, tier_name: str, items: list[Item], space_id: str) -> None:
        """Queue ``items`` for one tier if there is room now (promotions: nothing is owed). Call on the loop."""
        queue = self._queues[tier_name]
        tier = next(t for t in self.tiers if t.name == tier_name)
        for item in items:
            if not tier.accepts(len(item[1])):
                continue
            try:
                queue.put_nowait(item)
            except asyncio.QueueFull:
                self.stats.inc("rejected_blobs", tier=tier_name, space=space_id)

    def _count(self, counter: str, tier_name: str, keys: Sequence[str]) -> None:
        per_space: dict[str, int] = {}
        for key in keys:
            space_id = space_of(key)
            per_space[space_id] = per_space.get(space_id, 0) + 1
        for space_id, n in per_space.items():
            self.stats.inc(counter, n, tier=tier_name, space=space_id)

    def _drop(self, tier_name: str, keys: Sequence[str]) -> None:
        """Count blobs ``tier_name`` did not get and remember them for its re-sync (bounded)."""
        self._count("dropped_writes", tier_name, keys)
        if self.source is None:
            self._count("lost_writes", tier_name, keys)
            return
        missed = self._missed[tier_name]
        for key in keys:
            missed[key] = None
            missed.move_to_end(key)
        forgotten = [missed.popitem(last=False)[0] for _ in range(max(0, len(missed) - self.resync_keys))]
        if forgotten:
            self._count("lost_writes", tier_name, forgotten)

    # ----------------------------------------------------------------- writers and re-sync
    async def _write(self, tier: Tier, batch: list[Item]) -> bool:
        inflight = self._inflight[tier.name]
        inflight[id(batch)] = [k for k, _ in batch]
        ok = await self.guard.call(tier, "put", lambda: tier.put_many(batch), False, success=True)
        inflight.pop(id(batch), None)  # a cancellation leaves the batch here: stop() counts it unwritten
        if ok:
            per_space: dict[str, int] = {}
            for key, value in batch:
                space_id = space_of(key)
                per_space[space_id] = per_space.get(space_id, 0) + len(value)
            for space_id, nbytes in per_space.items():
                self.stats.inc("bytes_written", nbytes, tier=tier.name, space=space_id)
        return ok

    async def _writer(self, tier: Tier, queue: asyncio.Queue[Item]) -> None:
        while True:
            batch = [await queue.get()]
            while len(batch) < BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                if not await self._write(tier, batch):
                    self._drop(tier.name, [k for k, _ in batch])
            finally:
                for _ in batch:
                    queue.task_done()

    async def _resync(self, tier: Tier) -> None:
        """Write the blobs ``tier`` missed once it takes writes again, read back from the top tier."""
        assert self.source is not None
        missed, health = self._missed[tier.name], self.guard.health[tier.name]
        while True:
            await asyncio.sleep(self.resync_s)
            while missed and health.due():
                keys = [missed.popitem(last=False)[0] for _ in range(min(BATCH, len(missed)))]
                values = self.source(keys)
                batch = [(k, v) for k, v in zip(keys, values, strict=True) if v is not None]
                gone = [k for k, v in zip(keys, values, strict=True) if v is None]
                if gone:
                    self._count("lost_writes", tier.name, gone)
                if batch and not await self._write(tier, batch):
                    for key, _ in reversed(batch):
                        missed[key] = None
                        missed.move_to_end(key, last=False)
                    break
                self._count("resynced_writes", tier.name, [k for k, _ in batch])
