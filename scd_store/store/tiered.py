"""The tiered store's lifecycle and faces: code blobs by key over an ordered list of tiers.

Reads go through :class:`~scd_store.store.read_path.ReadPath` (walk, verify, promote); a put
writes the top tier on the caller's thread and hands the blobs to the
:class:`~scd_store.store.write_behind.WriteBehind` for every lower tier (write-behind: a lower
tier that misses a write gets it from the top tier when it comes back, within bounds; ``close``
reports what it could not write). Every tier call is
bounded by ``op_timeout_s`` and gated by the tier's health (:class:`~scd_store.store.guard.TierGuard`):
a failing tier is a miss, a ``tier_errors`` count and one log line per incident, and comes back
by itself. Callers hold a :class:`ProducerView` or a :class:`ConsumerView`, granted by the registry;
the registry's answers are cached and re-read whenever its version changes (checked every
``registry_refresh_s`` off the caller's thread), so a revoked pair stops being served within that.
With a :class:`~scd_store.store.signing.Keyring` every blob written is signed and every blob read
must verify.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from scd_store.store.blob import BlobMeta, encode_blob
from scd_store.store.guard import TierGuard
from scd_store.store.keys import validate_chunk_size
from scd_store.store.log_once import LogOnce
from scd_store.store.loop import LoopThread
from scd_store.store.read_path import ReadPath
from scd_store.store.records import NotRegistered, Pair, RegistryError, Space
from scd_store.store.registry import Registry
from scd_store.store.signing import Keyring
from scd_store.store.stats import StoreStats
from scd_store.store.stats_sinks import StatsSink
from scd_store.store.tiers.base import LocalTier, Tier
from scd_store.store.views import ConsumerView, ProducerView
from scd_store.store.write_behind import WriteBehind, space_of

log = logging.getLogger("scd_store.store")


def _per_tier(value: int | Sequence[int], n: int) -> list[int]:
    return [value] * n if isinstance(value, int) else list(value)


class TieredStore:
    """Code blobs over ``tiers`` (fastest first). Use as a context manager or call :meth:`close`."""

    def __init__(self, tiers: Sequence[Tier], registry: Registry, *, chunk_size: int = 256,
                 stats: StoreStats | None = None, op_timeout_s: float = 2.0, put_timeout_s: float = 30.0,
                 queue_size: int | Sequence[int] = 256, writers: int | Sequence[int] = 2,
                 backoff_min_s: float = 0.1, backoff_max_s: float = 5.0,
                 stats_sink: StatsSink | None = None, stats_flush_s: float = 1.0,
                 tier_timeouts: Mapping[str, float] | None = None, keyring: Keyring | None = None,
                 registry_refresh_s: float = 2.0, repair_s: float = 1.0) -> None:
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
        self._sink = stats_sink
        self._stats_flush_s = stats_flush_s
        self._mirror_task: asyncio.Task[None] | None = None
        self.keyring = keyring
        self.registry_refresh_s = registry_refresh_s
        self._registry_task: asyncio.Task[None] | None = None
        self.repair_s = repair_s
        self._repair_task: asyncio.Task[None] | None = None
        self._spaces: dict[tuple[str, str, str], Space | None] = {}  # None: revoked
        self._pairs: dict[tuple[str, str, str], tuple[Pair, Space] | None] = {}
        self._once = LogOnce(log)
        for tier in self.tiers:
            tier.set_evict_listener(self._on_evict)
            tier.attach(keyring=keyring, count=lambda name, n, t=tier.name: self.stats.inc(name, n, tier=t))
        # the registry's version checks get a thread of their own: no tier's I/O can hold revocation up
        self._registry_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scd-store-registry")
        self._loop = LoopThread()
        self.read = ReadPath(self.tiers, self.guard, self.stats, self._loop, self.write_behind, keyring)
        self._closed = False
        try:
            self._loop.run(self._start(), timeout=max(30.0, op_timeout_s))
        except BaseException:
            self._loop.stop()
            self._registry_executor.shutdown(wait=False, cancel_futures=True)
            raise

    # ----------------------------------------------------------------- lifecycle
    async def _start(self) -> None:
        for tier in self.tiers:
            try:
                await asyncio.wait_for(tier.start(), self.guard.timeouts[tier.name])
            except Exception as exc:  # a tier that cannot start is down, not fatal
                self.guard.failed(tier, exc)
        await self.write_behind.start()
        if self._sink is not None:
            self._mirror_task = asyncio.ensure_future(self._sink_loop())
        if self.registry_refresh_s > 0:
            try:  # before any answer is cached: a change from here on is seen
                seen: int | None = await asyncio.get_running_loop().run_in_executor(self._registry_executor,
                                                                                    self.registry.version)
            except Exception:  # noqa: BLE001 - an unreachable registry: the first successful read sets it
                seen = None
            self._registry_task = asyncio.ensure_future(self._registry_loop(seen))
        if self.repair_s > 0 and any(t.shared for t in self.tiers):
            self._repair_task = asyncio.ensure_future(self._repair_loop())

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
        self._registry_executor.shutdown(wait=False, cancel_futures=True)
        if self.unwritten:
            log.warning("scd-store: closed with blobs some tiers never got (%s): they are in the tiers above only",
                        ", ".join(f"{name}: {n}" for name, n in sorted(self.unwritten.items())))
        if self._sink is not None:
            with contextlib.suppress(Exception):
                self._sink.flush(self.stats)
            with contextlib.suppress(Exception):
                self._sink.close()
        return self.unwritten

    async def _stop(self, deadline: float) -> None:
        for task in (self._mirror_task, self._registry_task, self._repair_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
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

    # ----------------------------------------------------------------- faces
    def producer(self, space_id: str, producer_model_id: str, fingerprint: str) -> ProducerView:
        """The write face of one producer into its own space generation (checked against the registry;
        :class:`NotRegistered` once revoked)."""
        key = (space_id, producer_model_id, fingerprint)
        if key not in self._spaces:
            self._spaces[key] = self.registry.authorize_write(space_id, producer_model_id, fingerprint)
        space = self._spaces[key]
        if space is None:
            raise NotRegistered(f"code space {space_id!r} (fingerprint {fingerprint}) was revoked")
        return ProducerView(self, space, producer_model_id)

    def consumer(self, pair_id: str, consumer_model_id: str, space_fingerprint: str) -> ConsumerView:
        """The read face of one registered consumer; raises ``NotRegistered`` otherwise (or once revoked)."""
        key = (pair_id, consumer_model_id, space_fingerprint)
        if key not in self._pairs:
            self._pairs[key] = self.registry.resolve(pair_id, consumer_model_id, space_fingerprint)
        resolved = self._pairs[key]
        if resolved is None:
            raise NotRegistered(f"pair {pair_id!r} (space fingerprint {space_fingerprint}) was revoked")
        return ConsumerView(self, *resolved)

    def forget_registry_cache(self) -> None:
        """Read the registry afresh on the next :meth:`producer` / :meth:`consumer`."""
        self._spaces.clear()
        self._pairs.clear()

    def refresh_registry(self) -> None:
        """Re-read every cached registry answer (a revoked record becomes a refusal). Blocking: the
        store's loop runs it when the registry's version changes."""
        spaces = {k: _answer(self.registry.authorize_write, *k) for k in list(self._spaces)}
        pairs = {k: _answer(self.registry.resolve, *k) for k in list(self._pairs)}
        self._spaces.update(spaces)
        self._pairs.update(pairs)

    async def _registry_loop(self, seen: int | None) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.registry_refresh_s)
            try:
                version = await loop.run_in_executor(self._registry_executor, self.registry.version)
                if version != seen:  # None: the registry was unreachable at start, its answers are re-read
                    await loop.run_in_executor(self._registry_executor, self.refresh_registry)
                    self.stats.inc("registry_refreshes")
                seen = version
            except Exception as exc:  # noqa: BLE001 - an unreachable registry keeps the answers it gave
                log.debug("registry version check failed: %s", exc)

    def repair_now(self) -> tuple[int, int]:
        """One round of the producer's quarantine over every space this store writes (see
        :meth:`ReadPath.repair`): ``(quarantined, repaired)`` blobs."""
        return self._loop.run(self._repair_all(), timeout=30.0)

    async def _repair_all(self) -> tuple[int, int]:
        quarantined = repaired = 0
        for space in {s for s in list(self._spaces.values()) if s is not None}:
            q, r = await self.read.repair(space)
            quarantined, repaired = quarantined + q, repaired + r
        return quarantined, repaired

    async def _repair_loop(self) -> None:
        while True:
            await asyncio.sleep(self.repair_s)
            try:
                await self._repair_all()
            except Exception as exc:  # noqa: BLE001 - a failing round is retried next time
                log.debug("repair round failed: %s", exc)

    # ----------------------------------------------------------------- the write
    def write(self, space: Space, keys: Sequence[str], payloads: Sequence[bytes], token_counts: Sequence[int],
              codec_id: str) -> list[str]:
        """Blobs for ``payloads`` under ``keys``: the top tier now, the lower ones through the write-behind.

        Called by :class:`ProducerView` (whose space the registry authorised); returns the keys the top tier
        holds now. Every blob not returned is counted: ``unsigned_puts`` (no key), ``oversized_writes`` (over a
        tier's ``max_value_bytes``), or ``dropped_writes`` / ``lost_writes`` (the top tier failed)."""
        t0 = time.perf_counter()
        if not len(keys) == len(payloads) == len(token_counts):
            raise ValueError(f"{len(keys)} keys, {len(payloads)} payloads and {len(token_counts)} token counts "
                             "must match")
        signer = None
        if self.keyring is not None:
            signer = self.keyring.signer(space.space_id)
            if signer is None:
                self.stats.inc("unsigned_puts", len(keys), space=space.space_id)
                self._once.warn(f"unsigned:{space.space_id}", "scd-store: the keyring holds no valid private key for "
                                "space %s: not storing its codes (counted as unsigned_puts; logged once)",
                                space.space_id)
                return []
        items = [(key, encode_blob(BlobMeta(codec_id, space.fingerprint, int(count)), payload, key=key, signer=signer))
                 for key, payload, count in zip(keys, payloads, token_counts, strict=True)]
        if not items:
            return []
        top = self.tiers[0]
        fits = [item for item in items if top.accepts(len(item[1]))]
        if len(fits) < len(items):
            self.oversized(top, len(items) - len(fits), space.space_id)
        stored = self._put_top(top, fits, space.space_id)
        if len(self.tiers) > 1:
            self._loop.run(self.write_behind.enqueue(items, space.space_id), timeout=self.put_timeout_s + 5.0)
        self.stats.inc("puts", len(stored), space=space.space_id)
        self.stats.observe("put", time.perf_counter() - t0)
        return stored

    def _put_top(self, top: Tier, items: list[tuple[str, bytes]], space_id: str) -> list[str]:
        """Write ``items`` to the top tier; the keys it holds now (a failure is counted as lost there)."""
        if not items:
            return []
        if isinstance(top, LocalTier):
            try:
                top.put_many_now(items)
                self.health[top.name].succeeded()
                ok = True
            except Exception as exc:
                self.guard.failed(top, exc)
                ok = False
        else:
            ok = self._loop.run(self.guard.call(top, "put", lambda: top.put_many(items), False, success=True),
                                timeout=self.guard.timeouts[top.name] + 5.0)
        if not ok:  # nothing above it to re-sync from
            self.stats.inc("dropped_writes", len(items), tier=top.name, space=space_id)
            self.stats.inc("lost_writes", len(items), tier=top.name, space=space_id)
            return []
        self.stats.inc("bytes_written", sum(len(v) for _, v in items), tier=top.name, space=space_id)
        return [k for k, _ in items]

    def oversized(self, tier: Tier, count: int, space_id: str) -> None:
        """Count blobs larger than ``tier`` takes (``oversized_writes``; logged once per tier)."""
        self.stats.inc("oversized_writes", count, tier=tier.name, space=space_id)
        self._once.warn(f"oversized:{tier.name}", "scd-store: blobs larger than tier %s's max_value_bytes (%s) are "
                        "not written there (counted as oversized_writes; logged once)", tier.name,
                        tier.max_value_bytes)

    # ----------------------------------------------------------------- stats
    async def _sink_loop(self) -> None:
        assert self._sink is not None
        loop = asyncio.get_running_loop()
        failing = False
        while True:
            await asyncio.sleep(self._stats_flush_s)
            try:
                await loop.run_in_executor(None, self._sink.flush, self.stats)
                failing = False
            except Exception as exc:
                if not failing:
                    log.warning("store stats sink %s failed (%s); will keep retrying", type(self._sink).__name__, exc)
                failing = True

    def flush_stats(self) -> None:
        """Hand the counters to the stats sink now (Redis or this process's snapshot file)."""
        if self._sink is not None:
            self._sink.flush(self.stats)

    def _on_evict(self, tier_name: str, key: str, nbytes: int) -> None:
        self.stats.inc("evictions", tier=tier_name, space=space_of(key))


def _answer(resolve, *args):  # noqa: ANN001, ANN202 - a registry answer, or None once it is refused
    try:
        return resolve(*args)
    except RegistryError:
        return None
