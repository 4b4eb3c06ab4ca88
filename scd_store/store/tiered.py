"""The tiered store's lifecycle and faces: code blobs by key over an ordered list of tiers.

:class:`TieredStore` builds the parts and owns their lifetime: reads go through
:class:`~scd_store.store.read_path.ReadPath` (walk, verify, promote); a put goes through
:class:`~scd_store.store.writer.StoreWriter`, which writes the top tier on the caller's thread and hands the
blobs to the :class:`~scd_store.store.write_behind.WriteBehind` for every lower tier (a lower tier that misses
a write gets it from the top tier when it comes back, within bounds; ``close`` reports what it could not
write). Every tier call is bounded by ``op_timeout_s`` and gated by the tier's health
(:class:`~scd_store.store.guard.TierGuard`): a failing tier is a miss, a ``tier_errors`` count and one log
line per incident, and comes back by itself. Callers hold a :class:`ProducerView` or a
:class:`ConsumerView`, granted by the registry through the
:class:`~scd_store.store.registry_cache.RegistryCache` (a revoked pair stops being served within
``registry_refresh_s``). A producer's store repairs what readers reported in the shared tiers
(:class:`~scd_store.store.repair.ProducerRepair`, every ``repair_s``), and counters go to the stats sink
(:class:`~scd_store.store.stats_flush.StatsFlusher`, every ``stats_flush_s``). With a
:class:`~scd_store.store.signing.Keyring` every blob written is signed and every blob read must verify.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence

from scd_store.store import defaults
from scd_store.store.births import Births
from scd_store.store.guard import TierGuard
from scd_store.store.keyring import Keyring
from scd_store.store.keys import space_of, validate_chunk_size
from scd_store.store.loop import LoopThread
from scd_store.store.read_path import ReadPath
from scd_store.store.registry import Registry
from scd_store.store.registry_cache import RegistryCache
from scd_store.store.repair import ProducerRepair
from scd_store.store.stats import StoreStats
from scd_store.store.stats_flush import StatsFlusher
from scd_store.store.stats_sinks import StatsSink
from scd_store.store.tiers.base import LocalTier, Tier
from scd_store.store.views import ConsumerView, ProducerView
from scd_store.store.write_behind import WriteBehind
from scd_store.store.writer import StoreWriter

log = logging.getLogger("scd_store.store")


def _per_tier(value: int | Sequence[int], n: int) -> list[int]:
    return [value] * n if isinstance(value, int) else list(value)


class TieredStore:
    """Code blobs over ``tiers`` (fastest first). Use as a context manager or call :meth:`close`."""

    def __init__(self, tiers: Sequence[Tier], registry: Registry, *, chunk_size: int = defaults.CHUNK_SIZE,
                 stats: StoreStats | None = None, op_timeout_s: float = defaults.OP_TIMEOUT_S,
                 put_timeout_s: float = defaults.PUT_TIMEOUT_S, queue_size: int | Sequence[int] = defaults.QUEUE_SIZE,
                 writers: int | Sequence[int] = defaults.WRITERS, backoff_min_s: float = defaults.BACKOFF_MIN_S,
                 backoff_max_s: float = defaults.BACKOFF_MAX_S, stats_sink: StatsSink | None = None,
                 stats_flush_s: float = defaults.STATS_FLUSH_S, tier_timeouts: Mapping[str, float] | None = None,
                 keyring: Keyring | None = None, registry_refresh_s: float = defaults.REGISTRY_REFRESH_S,
                 repair_s: float = defaults.REPAIR_S, repair_rate: float = defaults.REPAIR_RATE) -> None:
        if not tiers:
            raise ValueError("the store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers = list(tiers)
        self.registry = registry
        self.chunk_size = validate_chunk_size(chunk_size)
        self.stats = stats if stats is not None else StoreStats()
        self.op_timeout_s = op_timeout_s
        self.put_timeout_s = put_timeout_s
        self.keyring = keyring
        self.registry_refresh_s = registry_refresh_s
        self.repair_s = repair_s
        self.guard = TierGuard(self.tiers, self.stats, op_timeout_s=op_timeout_s, backoff_min_s=backoff_min_s,
                               backoff_max_s=backoff_max_s, tier_timeouts=tier_timeouts)
        self.health = self.guard.health
        n = len(self.tiers)
        top = self.tiers[0]
        self.write_behind = WriteBehind(self.tiers[1:], self.guard, self.stats,
                                        queue_sizes=_per_tier(queue_size, n)[1:], writers=_per_tier(writers, n)[1:],
                                        put_timeout_s=put_timeout_s,
                                        source=top.get_many_now if isinstance(top, LocalTier) else None)
        self.unwritten: dict[str, int] = {}
        for tier in self.tiers:
            tier.set_evict_listener(self._on_evict)
            tier.attach(keyring=keyring, count=lambda name, n, space="", t=tier.name:
                        self.stats.inc(name, n, tier=t, space=space), produces=self.produces)
        self.registry_cache = RegistryCache(registry, self.stats, registry_refresh_s)
        self.stats_flusher = StatsFlusher(stats_sink, self.stats, stats_flush_s)
        self.births = Births()
        self.repairs = ProducerRepair(self.tiers, self.guard, self.stats, keyring, self.registry_cache.written,
                                      self.births, repair_rate)
        self._repair_task: asyncio.Task[None] | None = None
        self._loop = LoopThread()
        self.read = ReadPath(self.tiers, self.guard, self.stats, self._loop, self.write_behind, keyring)
        self.writer = StoreWriter(self.tiers, self.guard, self.stats, self._loop, self.write_behind,
                                  keyring=keyring, put_timeout_s=put_timeout_s, births=self.births)
        self._closed = False
        self._watched: set[str] = set()
        try:
            self._loop.run(self._start(), timeout=max(30.0, op_timeout_s))
        except BaseException:
            self._loop.stop()
            self.registry_cache.shutdown()
            raise

    # ----------------------------------------------------------------- lifecycle
    async def _start(self) -> None:
        for tier in self.tiers:
            try:
                await asyncio.wait_for(tier.start(), self.guard.timeouts[tier.name])
            except Exception as exc:  # a tier that cannot start is down, not fatal
                self.guard.failed(tier, exc)
        await self.write_behind.start()
        await self.stats_flusher.start()
        await self.registry_cache.start()
        if self.repair_s > 0 and any(t.shared for t in self.tiers):
            self._repair_task = asyncio.ensure_future(self.repairs.run(self.repair_s))

    def close(self, timeout: float | None = None) -> dict[str, int]:
        """Drain the write-behind for up to ``timeout`` s (default ``put_timeout_s``), flush stats, stop the
        loop. Returns, per lower tier, the blobs it did not get (also ``lost_writes``; logged)."""
        if self._closed:
            return self.unwritten
        self._closed = True
        deadline = self.put_timeout_s if timeout is None else timeout
        with contextlib.suppress(Exception):
            self._loop.run(self._stop(deadline), timeout=deadline + 10.0)
        self._loop.stop()
        self.registry_cache.shutdown()
        if self.unwritten:
            log.warning("scd-store: closed with blobs some tiers never got (%s): they are in the tiers above only",
                        ", ".join(f"{name}: {n}" for name, n in sorted(self.unwritten.items())))
        self.stats_flusher.close()
        return self.unwritten

    async def _stop(self, deadline: float) -> None:
        await self.stats_flusher.stop()
        await self.registry_cache.stop()
        if self._repair_task is not None:
            self._repair_task.cancel()
            await asyncio.gather(self._repair_task, return_exceptions=True)
        self.unwritten = await self.write_behind.stop(deadline)
        for tier in self.tiers:
            with contextlib.suppress(Exception):
                await tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write-behind has reached its tier (or failed)."""
        self._loop.run(self.write_behind.join(), timeout=timeout or self.put_timeout_s)

    def flush_stats(self) -> None:
        """Hand the counters to the stats sink now (Redis or this process's snapshot file)."""
        self.stats_flusher.flush()

    def produces(self, space_id: str) -> bool:
        """Whether this store's producers were granted ``space_id`` (and still are): the only spaces it publishes."""
        return any(space.space_id == space_id for space in self.registry_cache.written())

    # ----------------------------------------------------------------- faces
    def producer(self, space_id: str, producer_model_id: str, fingerprint: str) -> ProducerView:
        """The write face of one producer into its own space generation (checked against the registry;
        :class:`~scd_store.store.records.NotRegistered` once revoked)."""
        space = self.registry_cache.space(space_id, producer_model_id, fingerprint)
        if space.scope not in self._watched:  # its readers' reports reach this store from now on
            self._watched.add(space.scope)
            for tier in self.tiers:
                if tier.shared:
                    self._loop.loop.call_soon_threadsafe(tier.watch_reports, space.scope)
        return ProducerView(self.writer, self.read, space, producer_model_id)

    def consumer(self, pair_id: str, consumer_model_id: str, space_fingerprint: str) -> ConsumerView:
        """The read face of one registered consumer; raises ``NotRegistered`` otherwise (or once revoked)."""
        return ConsumerView(self.read, *self.registry_cache.pair(pair_id, consumer_model_id, space_fingerprint))

    def forget_registry_cache(self) -> None:
        """Read the registry afresh on the next :meth:`producer` / :meth:`consumer`."""
        self.registry_cache.forget()

    def repair_now(self) -> tuple[int, int]:
        """One round of the producer's repair over every space this store writes
        (:class:`~scd_store.store.repair.ProducerRepair`): ``(quarantined, repaired)`` blobs."""
        return self._loop.run(self.repairs.all_spaces(), timeout=30.0)

    def _on_evict(self, tier_name: str, key: str, nbytes: int) -> None:
        self.stats.inc("evictions", tier=tier_name, space=space_of(key))
