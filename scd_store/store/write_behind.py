"""The write-behind: bounded queues to every tier below the top, drained by background writers.

A put offers its blobs to each lower tier's queue. A full queue blocks the putting thread up to
``put_timeout_s`` (back-pressure), then drops the rest of the batch for that tier and counts it
(``rejected_blobs``). Writers on the store's event loop drain their queue in batches of up to 32
through the tier guard; what a tier refuses is counted too. Promotions offer without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from scd_store.store.guard import TierGuard
from scd_store.store.stats import StoreStats
from scd_store.store.tiers.base import Tier

log = logging.getLogger("scd_store.store")
Item = tuple[str, bytes]
BATCH = 32


def space_of(key: str) -> str:
    """The space id of a store key (``scd:{space}:{generation}:{hash}``), or "" for a malformed one."""
    parts = key.split(":", 3)
    return parts[1] if len(parts) == 4 else ""


class WriteBehind:
    """Queues and writers for ``tiers`` (the store's tiers below the top one)."""

    def __init__(self, tiers: Sequence[Tier], guard: TierGuard, stats: StoreStats, *, queue_sizes: Sequence[int],
                 writers: Sequence[int], put_timeout_s: float) -> None:
        if not len(tiers) == len(queue_sizes) == len(writers):
            raise ValueError("one queue size and one writer count per lower tier")
        self.tiers = list(tiers)
        self.guard = guard
        self.stats = stats
        self.put_timeout_s = put_timeout_s
        self._queue_sizes = list(queue_sizes)
        self._writers = list(writers)
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # ----------------------------------------------------------------- lifecycle (on the store's loop)
    async def start(self) -> None:
        """Create the queues and start the writers."""
        for tier, size, count in zip(self.tiers, self._queue_sizes, self._writers, strict=True):
            queue: asyncio.Queue[Item] = asyncio.Queue(size)
            self._queues[tier.name] = queue
            for _ in range(count):
                self._tasks.append(asyncio.ensure_future(self._writer(tier, queue)))

    async def join(self) -> None:
        """Until every queued blob has reached its tier (or failed)."""
        await asyncio.gather(*(q.join() for q in self._queues.values()))

    async def stop(self) -> None:
        """Cancel the writers (what is still queued is not written)."""
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ----------------------------------------------------------------- offering blobs
    async def enqueue(self, items: list[Item], space_id: str) -> None:
        """Queue ``items`` for every lower tier, waiting up to ``put_timeout_s`` in all for room."""
        deadline = time.monotonic() + self.put_timeout_s
        for name, queue in self._queues.items():
            for n, item in enumerate(items):
                try:
                    await asyncio.wait_for(queue.put(item), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    self.stats.inc("rejected_blobs", len(items) - n, tier=name, space=space_id)
                    log.warning("store tier %s write queue full for %.1f s: dropped %d blobs", name,
                                self.put_timeout_s, len(items) - n)
                    break

    def offer_nowait(self, tier_name: str, items: list[Item], space_id: str) -> None:
        """Queue ``items`` for one tier if there is room now; count what does not fit. Call on the loop."""
        queue = self._queues[tier_name]
        for item in items:
            try:
                queue.put_nowait(item)
            except asyncio.QueueFull:
                self.stats.inc("rejected_blobs", tier=tier_name, space=space_id)

    # ----------------------------------------------------------------- writers
    async def _writer(self, tier: Tier, queue: asyncio.Queue[Item]) -> None:
        while True:
            batch = [await queue.get()]
            while len(batch) < BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                ok = await self.guard.call(tier, "put", lambda b=batch: tier.put_many(b), False, True)
                per_space: dict[str, list[int]] = {}
                for key, value in batch:
                    counts = per_space.setdefault(space_of(key), [0, 0])
                    counts[0] += 1
                    counts[1] += len(value)
                for space_id, (count, nbytes) in per_space.items():
                    if ok:
                        self.stats.inc("bytes_written", nbytes, tier=tier.name, space=space_id)
                    else:
                        self.stats.inc("rejected_blobs", count, tier=tier.name, space=space_id)
            finally:
                for _ in batch:
                    queue.task_done()
