"""The tiered store: prefix lookups, gets and puts of code blobs over an ordered list of tiers.

- Lookup walks the tiers fastest first, per chunk; the answer is the longest leading run of chunks
  present. A get verifies every blob (checksum, version, space fingerprint); a bad blob is a miss,
  is evicted from the tier that held it and is counted. Hits from a lower tier are promoted upward.
- A put writes the top tier synchronously and queues the blobs for every lower tier (bounded
  queues; a full queue blocks the producer up to ``put_timeout_s``: back-pressure). Background
  writers on the store's event loop drain the queues in batches.
- A failing tier is a miss, a ``tier_errors`` count and one log line per incident; it is retried
  with backoff and comes back by itself. Every tier call is bounded by ``op_timeout_s``.

The narrow faces are :class:`ProducerView` (put into its own space) and :class:`ConsumerView`
(lookups and gets through its pair; it has no write method). Who may do what comes from the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from scd_store.store.blob import Blob, BlobError, BlobMeta, Section, decode_blob, encode_blob
from scd_store.store.health import TierHealth
from scd_store.store.keys import chunk_keys, hash_keys, validate_chunk_size
from scd_store.store.loop import LoopThread
from scd_store.store.registry import Pair, Registry, Space
from scd_store.store.stats import RedisStatsMirror, StoreStats, write_snapshot_file
from scd_store.store.tiers.base import LocalTier, Tier

log = logging.getLogger("scd_store.store")
T = TypeVar("T")
Tokens = Sequence[int] | np.ndarray


@dataclass(frozen=True, slots=True)
class CodeChunk:
    """One verified chunk out of the store: its key, position, tokens covered, codec payload and header."""

    key: str
    index: int
    token_count: int
    payload: memoryview
    meta: BlobMeta
    tier: str


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A lookup's answer: the leading run of chunks present, and which tier holds each of them."""

    hit_chunks: int
    hit_tokens: int
    total_chunks: int
    tiers: tuple[str, ...]


@dataclass(slots=True)
class _Found:
    blob: Blob
    raw: bytes
    tier_index: int


class TieredStore:
    """Code blobs over ``tiers`` (fastest first). Use as a context manager or call :meth:`close`."""

    def __init__(self, tiers: Sequence[Tier], registry: Registry, *, chunk_size: int = 256,
                 stats: StoreStats | None = None, op_timeout_s: float = 2.0, put_timeout_s: float = 30.0,
                 queue_size: int | Sequence[int] = 256, writers: int | Sequence[int] = 2,
                 backoff_min_s: float = 0.1, backoff_max_s: float = 5.0,
                 stats_mirror: RedisStatsMirror | None = None, stats_flush_s: float = 1.0,
                 snapshot_path: str | None = None) -> None:
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
        n = len(self.tiers)
        self._queue_sizes = [queue_size] * n if isinstance(queue_size, int) else list(queue_size)
        self._writers = [writers] * n if isinstance(writers, int) else list(writers)
        self.health = {t.name: TierHealth(t.name, backoff_min_s, backoff_max_s) for t in self.tiers}
        self._mirror = stats_mirror
        self._stats_flush_s = stats_flush_s
        self._snapshot_path = snapshot_path
        self._queues: dict[str, asyncio.Queue[tuple[str, bytes]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._spaces: dict[tuple[str, str], Space] = {}
        self._pairs: dict[tuple[str, str], tuple[Pair, Space]] = {}
        for tier in self.tiers:
            tier.set_evict_listener(self._on_evict)
        self._loop = LoopThread()
        self._closed = False
        try:
            self._loop.run(self._start(), timeout=max(30.0, op_timeout_s))
        except BaseException:
            self._loop.stop()
            raise

    # ----------------------------------------------------------------- lifecycle
    async def _start(self) -> None:
        for i, tier in enumerate(self.tiers):
            try:
                await asyncio.wait_for(tier.start(), self.op_timeout_s)
            except Exception as exc:  # a tier that cannot start is down, not fatal
                self.stats.inc("tier_errors", tier=tier.name)
                self.health[tier.name].failed(exc)
            if i > 0:
                queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(self._queue_sizes[i])
                self._queues[tier.name] = queue
                for _ in range(self._writers[i]):
                    self._tasks.append(asyncio.ensure_future(self._writer(tier, queue)))
        if self._mirror is not None:
            self._tasks.append(asyncio.ensure_future(self._mirror_loop()))

    def close(self) -> None:
        """Drain the write queues (up to ``put_timeout_s``), flush stats, stop the loop."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.flush()
        with contextlib.suppress(Exception):
            self._loop.run(self._stop(), timeout=self.put_timeout_s)
        self._loop.stop()
        if self._mirror is not None:
            with contextlib.suppress(Exception):
                self._mirror.flush(self.stats)
            self._mirror.close()
        if self._snapshot_path:
            with contextlib.suppress(OSError):
                write_snapshot_file(self.stats, self._snapshot_path)

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for tier in self.tiers:
            with contextlib.suppress(Exception):
                await tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write-through has reached its tier (or failed)."""
        async def _join() -> None:
            await asyncio.gather(*(q.join() for q in self._queues.values()))
        self._loop.run(_join(), timeout=timeout or self.put_timeout_s)

    # ----------------------------------------------------------------- faces
    def producer(self, space_id: str, producer_model_id: str) -> ProducerView:
        """The write face of one producer into its own space (checked against the registry)."""
        return ProducerView(self, self._authorize(space_id, producer_model_id), producer_model_id)

    def consumer(self, pair_id: str, consumer_model_id: str) -> ConsumerView:
        """The read face of one registered consumer; raises ``NotRegistered`` otherwise."""
        pair, space = self._resolve(pair_id, consumer_model_id)
        return ConsumerView(self, pair, space)

    def _authorize(self, space_id: str, producer_model_id: str) -> Space:
        key = (space_id, producer_model_id)
        space = self._spaces.get(key)
        if space is None:
            space = self.registry.authorize_write(space_id, producer_model_id)
            self._spaces[key] = space
        return space

    def _resolve(self, pair_id: str, consumer_model_id: str) -> tuple[Pair, Space]:
        key = (pair_id, consumer_model_id)
        resolved = self._pairs.get(key)
        if resolved is None:
            resolved = self.registry.resolve(pair_id, consumer_model_id)
            self._pairs[key] = resolved
        return resolved

    def forget_registry_cache(self) -> None:
        self._spaces.clear()
        self._pairs.clear()

    # ----------------------------------------------------------------- public operations
    def put(self, space_id: str, tokens: Tokens, payloads: Sequence[bytes], *, producer: str, codec_id: str,
            layer_roles: Sequence[str] = (), code_dtypes: Sequence[str] = (), bit_widths: Sequence[int] = (),
            sections: Sequence[Sequence[Section]] | None = None) -> list[str]:
        """Store one payload per whole chunk of ``tokens`` (the first ``len(payloads)`` chunks).

        Only ``producer``, the space's registered producer, may write. Returns the keys written.
        """
        space = self._authorize(space_id, producer)
        return self._put(space, tokens, payloads, codec_id, tuple(layer_roles), tuple(code_dtypes),
                         tuple(bit_widths), sections)

    def get(self, pair_id: str, tokens: Tokens, *, consumer: str) -> list[CodeChunk]:
        """The verified leading chunks of ``tokens`` for a registered consumer's pair."""
        pair, space = self._resolve(pair_id, consumer)
        return self._get(space, tokens, pair.pair_id)

    def contains_prefix(self, space_id: str, tokens: Tokens, *, pair: str = "") -> int:
        """Tokens covered by the longest leading run of chunks of ``tokens`` present in any tier."""
        return self.lookup_prefix(space_id, tokens, pair=pair).hit_tokens

    def lookup_prefix(self, space_id: str, tokens: Tokens, *, pair: str = "") -> PrefixHit:
        """Like :meth:`contains_prefix`, with the tier of each leading chunk."""
        return self._lookup_keys(space_id, chunk_keys(space_id, tokens, self.chunk_size), pair)

    def _lookup_keys(self, space_id: str, keys: list[str], pair: str = "") -> PrefixHit:
        t0 = time.perf_counter()
        where = self._walk(keys, "contains", None)
        run = _leading_run(where)
        tiers = tuple(self.tiers[where[i]].name for i in range(run))  # type: ignore[index]
        self.stats.inc("lookups", space=space_id, pair=pair)
        self.stats.inc("miss_chunks", len(keys) - run, space=space_id, pair=pair)
        self.stats.observe("lookup", time.perf_counter() - t0)
        return PrefixHit(run, run * self.chunk_size, len(keys), tiers)

    # ----------------------------------------------------------------- internals: read
    def _walk(self, keys: list[str], op: str, space: Space | None) -> list[Any]:
        """Per key: the tier index that has it (``contains``) or a ``_Found`` (``get``); None when absent."""
        results: list[Any] = [None] * len(keys)
        pending = list(range(len(keys)))
        first_remote = next((i for i, t in enumerate(self.tiers) if not t.local), len(self.tiers))
        for ti in range(first_remote):
            if not pending:
                break
            pending, bad = self._absorb(ti, pending, keys, results, op, space,
                                        self._local_call(ti, op, keys, pending))
            if bad:
                tier = self.tiers[ti]
                assert isinstance(tier, LocalTier)
                for key in bad:
                    with contextlib.suppress(Exception):
                        tier.delete_now(key)
        if pending and first_remote < len(self.tiers):
            self._loop.run(self._walk_remote(first_remote, pending, keys, results, op, space),
                           timeout=self.op_timeout_s * (len(self.tiers) - first_remote) + 5.0)
        return results

    async def _walk_remote(self, start: int, pending: list[int], keys: list[str], results: list[Any], op: str,
                           space: Space | None) -> None:
        for ti in range(start, len(self.tiers)):
            if not pending:
                return
            tier = self.tiers[ti]
            batch = [keys[i] for i in pending]
            fn = (lambda t=tier, b=batch: t.contains_many(b)) if op == "contains" else (
                lambda t=tier, b=batch: t.get_many(b))
            values = await self._call(tier, op, fn, None)
            pending, bad = self._absorb(ti, pending, keys, results, op, space, values)
            if bad:
                await self._call(tier, "delete", lambda t=tier, b=bad: t.delete_many(b), 0)

    def _local_call(self, ti: int, op: str, keys: list[str], pending: list[int]) -> list[Any] | None:
        tier = self.tiers[ti]
        assert isinstance(tier, LocalTier)
        health = self.health[tier.name]
        if not health.should_try():
            return None
        batch = [keys[i] for i in pending]
        t0 = time.perf_counter()
        try:
            values = tier.contains_many_now(batch) if op == "contains" else tier.get_many_now(batch)
        except Exception as exc:
            self.stats.inc("tier_errors", tier=tier.name)
            health.failed(exc)
            return None
        health.succeeded()
        self.stats.observe(op, time.perf_counter() - t0, tier=tier.name)
        return values

    def _absorb(self, ti: int, pending: list[int], keys: list[str], results: list[Any], op: str,
                space: Space | None, values: list[Any] | None) -> tuple[list[int], list[str]]:
        """Record what tier ``ti`` returned; return the still-missing indices and the keys of bad blobs."""
        if values is None:
            return pending, []
        still: list[int] = []
        bad: list[str] = []
        for i, value in zip(pending, values, strict=True):
            if op == "contains":
                if value:
                    results[i] = ti
                else:
                    still.append(i)
                continue
            if value is None:
                still.append(i)
                continue
            try:
                blob = decode_blob(value, expect_space_fingerprint=space.fingerprint if space else None)
            except BlobError as exc:
                bad.append(keys[i])
                still.append(i)
                log.debug("corrupt blob %s in tier %s: %s", keys[i], self.tiers[ti].name, exc)
                continue
            results[i] = _Found(blob, value, ti)
        if bad:
            self.stats.inc("corrupt_blobs", len(bad), tier=self.tiers[ti].name, space=space.space_id if space else "")
        return still, bad

    def _get(self, space: Space, tokens: Tokens, pair_id: str) -> list[CodeChunk]:
        return self._get_keys(space, chunk_keys(space.space_id, tokens, self.chunk_size), pair_id)

    def _get_keys(self, space: Space, keys: list[str], pair_id: str) -> list[CodeChunk]:
        t0 = time.perf_counter()
        found = self._walk(keys, "get", space)
        run = _leading_run(found)
        chunks: list[CodeChunk] = []
        per_tier: dict[int, list[int]] = {}
        for i in range(run):
            f: _Found = found[i]
            chunks.append(CodeChunk(keys[i], i, f.blob.meta.token_count, f.blob.payload, f.blob.meta,
                                    self.tiers[f.tier_index].name))
            per_tier.setdefault(f.tier_index, []).append(i)
        for ti, idx in per_tier.items():
            self.stats.record_hit(tier=self.tiers[ti].name, space=space.space_id, pair=pair_id, chunks=len(idx),
                                  tokens=sum(found[i].blob.meta.token_count for i in idx),
                                  nbytes=sum(len(found[i].raw) for i in idx),
                                  raw_kv_bytes_per_token=space.raw_kv_bytes_per_token)
            if ti > 0:
                self._promote(ti, [(keys[i], found[i].raw) for i in idx], space.space_id)
        self.stats.inc("lookups", space=space.space_id, pair=pair_id)
        self.stats.inc("miss_chunks", len(keys) - run, space=space.space_id, pair=pair_id)
        self.stats.observe("get", time.perf_counter() - t0)
        return chunks

    def _promote(self, from_tier: int, items: list[tuple[str, bytes]], space_id: str) -> None:
        for ti in range(from_tier):
            tier = self.tiers[ti]
            if isinstance(tier, LocalTier):
                with contextlib.suppress(Exception):
                    tier.put_many_now(items)
            else:
                self._loop.loop.call_soon_threadsafe(self._enqueue_nowait, tier.name, items, space_id)
            self.stats.inc("promotions", len(items), tier=tier.name, space=space_id)

    def _enqueue_nowait(self, tier_name: str, items: list[tuple[str, bytes]], space_id: str) -> None:
        queue = self._queues[tier_name]
        for item in items:
            try:
                queue.put_nowait(item)
            except asyncio.QueueFull:
                self.stats.inc("rejected_blobs", tier=tier_name, space=space_id)

    # ----------------------------------------------------------------- internals: write
    def _put(self, space: Space, tokens: Tokens, payloads: Sequence[bytes], codec_id: str,
             layer_roles: tuple[str, ...], code_dtypes: tuple[str, ...], bit_widths: tuple[int, ...],
             sections: Sequence[Sequence[Section]] | None) -> list[str]:
        keys = chunk_keys(space.space_id, tokens, self.chunk_size)
        if len(payloads) > len(keys):
            raise ValueError(f"{len(payloads)} payloads for {len(keys)} whole chunks of {self.chunk_size} tokens")
        return self._put_keys(space, keys[:len(payloads)], payloads, [self.chunk_size] * len(payloads), codec_id,
                              layer_roles, code_dtypes, bit_widths, sections)

    def _put_keys(self, space: Space, keys: Sequence[str], payloads: Sequence[bytes], token_counts: Sequence[int],
                  codec_id: str, layer_roles: tuple[str, ...] = (), code_dtypes: tuple[str, ...] = (),
                  bit_widths: tuple[int, ...] = (), sections: Sequence[Sequence[Section]] | None = None
                  ) -> list[str]:
        t0 = time.perf_counter()
        if not len(keys) == len(payloads) == len(token_counts):
            raise ValueError(f"{len(keys)} keys, {len(payloads)} payloads and {len(token_counts)} token counts "
                             "must match")
        if sections is not None and len(sections) != len(payloads):
            raise ValueError("sections must give one tuple per payload")
        items = []
        for i, payload in enumerate(payloads):
            meta = BlobMeta(codec_id, space.fingerprint, int(token_counts[i]), layer_roles, code_dtypes, bit_widths,
                            tuple(sections[i]) if sections is not None else ())
            items.append((keys[i], encode_blob(meta, payload)))
        if not items:
            return []
        nbytes = sum(len(v) for _, v in items)
        top = self.tiers[0]
        if isinstance(top, LocalTier):
            health = self.health[top.name]
            try:
                top.put_many_now(items)
                health.succeeded()
                self.stats.inc("bytes_written", nbytes, tier=top.name, space=space.space_id)
            except Exception as exc:
                self.stats.inc("tier_errors", tier=top.name)
                health.failed(exc)
        else:
            ok = self._loop.run(self._call(top, "put", lambda: top.put_many(items), False, True),
                                timeout=self.op_timeout_s + 5.0)
            if ok:
                self.stats.inc("bytes_written", nbytes, tier=top.name, space=space.space_id)
        if len(self.tiers) > 1:
            self._loop.run(self._enqueue(items, space.space_id), timeout=self.put_timeout_s + 5.0)
        self.stats.inc("puts", len(items), space=space.space_id)
        self.stats.observe("put", time.perf_counter() - t0)
        return [k for k, _ in items]

    async def _enqueue(self, items: list[tuple[str, bytes]], space_id: str) -> None:
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

    async def _writer(self, tier: Tier, queue: asyncio.Queue[tuple[str, bytes]]) -> None:
        while True:
            batch = [await queue.get()]
            while len(batch) < 32 and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                ok = await self._call(tier, "put", lambda b=batch: tier.put_many(b), False, True)
                per_space: dict[str, list[int]] = {}
                for key, value in batch:
                    counts = per_space.setdefault(key.split(":", 2)[1], [0, 0])
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

    async def _call(self, tier: Tier, op: str, fn: Callable[[], Awaitable[T]], default: T,
                    success: Any = None) -> T:
        """Run one tier operation under its health gate and the op timeout; a failure returns ``default``."""
        health = self.health[tier.name]
        if not health.should_try():
            return default
        t0 = time.perf_counter()
        try:
            result = await asyncio.wait_for(fn(), self.op_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.inc("tier_errors", tier=tier.name)
            health.failed(exc)
            return default
        health.succeeded()
        self.stats.observe(op, time.perf_counter() - t0, tier=tier.name)
        return success if success is not None else result

    async def _mirror_loop(self) -> None:
        assert self._mirror is not None
        loop = asyncio.get_running_loop()
        failing = False
        while True:
            await asyncio.sleep(self._stats_flush_s)
            try:
                await loop.run_in_executor(None, self._mirror.flush, self.stats)
                failing = False
            except Exception as exc:
                if not failing:
                    log.warning("store stats mirror to Redis failed (%s); will keep retrying", exc)
                failing = True

    def flush_stats(self) -> None:
        """Push pending counter deltas to Redis now (when a mirror is configured)."""
        if self._mirror is not None:
            self._mirror.flush(self.stats)

    def _on_evict(self, tier_name: str, key: str, nbytes: int) -> None:
        parts = key.split(":", 2)
        self.stats.inc("evictions", tier=tier_name, space=parts[1] if len(parts) == 3 else "")


def _leading_run(results: list[Any]) -> int:
    for i, r in enumerate(results):
        if r is None:
            return i
    return len(results)


class ProducerView:
    """A producer's face: put into its own space, and look up what is already there."""

    def __init__(self, store: TieredStore, space: Space, producer_model_id: str) -> None:
        self.store = store
        self.space = space
        self.producer_model_id = producer_model_id

    def put(self, tokens: Tokens, payloads: Sequence[bytes], *, codec_id: str, layer_roles: Sequence[str] = (),
            code_dtypes: Sequence[str] = (), bit_widths: Sequence[int] = (),
            sections: Sequence[Sequence[Section]] | None = None) -> list[str]:
        return self.store._put(self.space, tokens, payloads, codec_id, tuple(layer_roles), tuple(code_dtypes),
                               tuple(bit_widths), sections)

    def contains_prefix(self, tokens: Tokens) -> int:
        return self.store.contains_prefix(self.space.space_id, tokens)

    def put_hashes(self, hashes: Sequence[bytes], payloads: Sequence[bytes], token_counts: Sequence[int], *,
                   codec_id: str) -> list[str]:
        """Store payloads under engine-computed chunk hashes (16 bytes each), e.g. LMCache's or SGLang's."""
        keys = hash_keys(self.space.space_id, hashes)
        return self.store._put_keys(self.space, keys, payloads, token_counts, codec_id)

    def contains_hashes(self, hashes: Sequence[bytes]) -> int:
        """Length of the leading run of ``hashes`` present in any tier."""
        keys = hash_keys(self.space.space_id, hashes)
        return self.store._lookup_keys(self.space.space_id, keys).hit_chunks


class ConsumerView:
    """A registered consumer's face: lookups and verified gets in its pair's space. It cannot write."""

    def __init__(self, store: TieredStore, pair: Pair, space: Space) -> None:
        self.store = store
        self.pair = pair
        self.space = space

    def contains_prefix(self, tokens: Tokens) -> int:
        return self.store.contains_prefix(self.space.space_id, tokens, pair=self.pair.pair_id)

    def lookup_prefix(self, tokens: Tokens) -> PrefixHit:
        return self.store.lookup_prefix(self.space.space_id, tokens, pair=self.pair.pair_id)

    def get(self, tokens: Tokens) -> list[CodeChunk]:
        return self.store._get(self.space, tokens, self.pair.pair_id)

    def contains_hashes(self, hashes: Sequence[bytes]) -> int:
        """Length of the leading run of engine-computed chunk ``hashes`` present in any tier."""
        keys = hash_keys(self.space.space_id, hashes)
        return self.store._lookup_keys(self.space.space_id, keys, self.pair.pair_id).hit_chunks

    def get_hashes(self, hashes: Sequence[bytes]) -> list[CodeChunk]:
        """The verified leading run of chunks stored under engine-computed ``hashes``."""
        keys = hash_keys(self.space.space_id, hashes)
        return self.store._get_keys(self.space, keys, self.pair.pair_id)
