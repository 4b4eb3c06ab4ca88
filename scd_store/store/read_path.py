"""The reader's path: walk the tiers fastest first, verify every blob, promote hits upward.

- A lookup's answer is the longest leading run of chunks present in any tier (:meth:`ReadPath.lookup`:
  presence only, per key the index of the tier holding it).
- A get verifies every blob (:func:`~scd_store.store.verify.verify_blob`); a bad blob is a miss and is
  counted (``corrupt_blobs``, ``bad_signatures``, ``foreign_blobs``); the walk goes on to the next tier for
  it. Readers delete a bad blob only from this host's tiers (CPU, GPU, disk), never from a shared one
  (Redis, peers): there they report its key (``report_suspects``), and report their verified hits
  (``report_hits``) instead of refreshing a TTL themselves. The space's producer takes both
  (:class:`~scd_store.store.repair.ProducerRepair`).
- Local tiers (CPU, GPU) are read on the caller's thread; the rest on the store's event loop.
- The GPU tier verified its blobs as they entered (:class:`~scd_store.store.tiers.gpu.GpuTier`): a hit there is
  its kept header, checked against the reader's space (:func:`~scd_store.store.verify.verify_held`), and its
  payload as a tensor view on the device (a :class:`CodeChunk` whose payload is a tensor), never copied to the
  host (its bytes are read back only to promote it to a tier above it), recorded on the reader's current CUDA
  stream so an eviction and re-upload cannot overwrite it under a decode that stream still has queued.
- Hits from a lower tier are copied into every tier above it (local tiers at once, remote ones
  through the write-behind, never blocking the reader).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from scd_store.store.blob import BlobError, BlobMeta, ForeignBlob, SignatureError, UnknownKey
from scd_store.store.guard import TierGuard
from scd_store.store.keyring import Keyring
from scd_store.store.loop import LoopThread
from scd_store.store.records import Space
from scd_store.store.results import CodeChunk, Payload, PrefixHit
from scd_store.store.stats import StoreStats
from scd_store.store.tiers.base import LocalTier, Tier
from scd_store.store.tiers.gpu import DeviceBlob, GpuTier
from scd_store.store.verify import verify_blob, verify_held
from scd_store.store.write_behind import WriteBehind

log = logging.getLogger("scd_store.store")


@dataclass(slots=True)
class _Found:
    """A verified blob of a get: its header, its payload (host bytes, or a GPU tier's tensor view), its size as
    stored, the index of the tier that held it, and its bytes as stored (None for a GPU tier's blob: read back
    only to promote it)."""

    meta: BlobMeta
    payload: Payload
    nbytes: int
    tier_index: int
    raw: bytes | None


def leading_run(results: Sequence[object | None]) -> int:
    """How many leading entries of ``results`` are not None."""
    for i, r in enumerate(results):
        if r is None:
            return i
    return len(results)


class ReadPath:
    """Lookups and verified gets of store keys over ``tiers`` (fastest first)."""

    def __init__(self, tiers: Sequence[Tier], guard: TierGuard, stats: StoreStats, loop: LoopThread,
                 write_behind: WriteBehind, keyring: Keyring | None = None) -> None:
        self.keyring = keyring
        self._reports: set[object] = set()  # hit reports in flight (fire and forget)
        self.tiers = list(tiers)
        self.guard = guard
        self.stats = stats
        self.loop = loop
        self.write_behind = write_behind
        self._first_remote = next((i for i, t in enumerate(self.tiers) if not t.local), len(self.tiers))

    # ----------------------------------------------------------------- operations
    def lookup(self, space: Space, keys: list[str], pair: str = "") -> PrefixHit:
        """The leading run of ``keys`` present in any tier (presence only: nothing is read or verified)."""
        t0 = time.perf_counter()
        where = self._where(keys)
        run = leading_run(where)
        tiers = tuple(self.tiers[ti].name for ti in where[:run] if ti is not None)
        remote = sum(1 for ti in where[:run] if ti is not None and ti >= self._first_remote)
        self.stats.inc("lookups", space=space.space_id, pair=pair)
        self.stats.inc("miss_chunks", len(keys) - run, space=space.space_id, pair=pair)
        self.stats.observe("lookup", time.perf_counter() - t0)
        return PrefixHit(run, len(keys), tiers, remote)

    def readable_by_others(self, space: Space, keys: list[str]) -> int:
        """The leading run of ``keys`` present in a tier other processes read (Redis, peers), presence only and
        not counted as a lookup: what a producer's consumers elsewhere can get. A shared tier that cannot
        answer counts as holding them (never store again on a guess); with no shared tier, every tier counts."""
        shared = [t for t in self.tiers if t.shared]
        if not shared:
            return leading_run(self._where(keys))
        return self.loop.run(self._shared_run(shared, keys), timeout=self.guard.deadline(shared) + 5.0)

    async def _shared_run(self, shared: list[Tier], keys: list[str]) -> int:
        present = [False] * len(keys)
        for tier in shared:
            pending = [i for i, p in enumerate(present) if not p]
            if not pending:
                break
            found = await self.guard.call(tier, "contains", lambda t=tier, b=[keys[i] for i in pending]:
                                          t.contains_many(b), None)
            if found is None:
                return len(keys)
            for i, hit in zip(pending, found, strict=True):
                present[i] = present[i] or bool(hit)
        return leading_run([True if p else None for p in present])

    def get(self, space: Space, keys: list[str], pair_id: str) -> list[CodeChunk]:
        """The verified leading run of ``keys`` in ``space``; hits are counted per tier and promoted."""
        t0 = time.perf_counter()
        found = self._found(keys, space)
        run = leading_run(found)
        chunks: list[CodeChunk] = []
        per_tier: dict[int, list[tuple[str, _Found]]] = {}
        for i, f in enumerate(found[:run]):
            assert f is not None
            chunks.append(CodeChunk(keys[i], i, f.meta.token_count, f.payload, f.meta, self.tiers[f.tier_index].name))
            per_tier.setdefault(f.tier_index, []).append((keys[i], f))
        for ti, hits in per_tier.items():
            self.stats.record_hit(tier=self.tiers[ti].name, space=space.space_id, pair=pair_id, chunks=len(hits),
                                  tokens=sum(f.meta.token_count for _, f in hits),
                                  nbytes=sum(f.nbytes for _, f in hits),
                                  raw_kv_bytes_per_token=space.raw_kv_bytes_per_token)
            if ti > 0:
                self._promote(ti, self._raw(ti, hits), space.space_id)
        self.stats.inc("lookups", space=space.space_id, pair=pair_id)
        self.stats.inc("miss_chunks", len(keys) - run, space=space.space_id, pair=pair_id)
        self.stats.observe("get", time.perf_counter() - t0)
        return chunks

    # ----------------------------------------------------------------- presence: the tier holding each key
    def _where(self, keys: list[str]) -> list[int | None]:
        """Per key: the index of the first tier that holds it, None when none does."""
        where: list[int | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for ti in range(self._first_remote):
            if not pending:
                break
            tier = self.tiers[ti]
            assert isinstance(tier, LocalTier)
            held = self.guard.call_now(tier, "contains", lambda t=tier, b=[keys[i] for i in pending]:
                                       t.contains_many_now(b))
            pending = _mark(ti, pending, held, where)
        if pending and self._first_remote < len(self.tiers):
            self._run_remote(self._where_remote(pending, keys, where))
        return where

    def _run_remote(self, walk: Coroutine[Any, Any, None]) -> None:
        """The remote half of a walk on the store's loop, bounded by the remote tiers' deadline."""
        self.loop.run(walk, timeout=self.guard.deadline(self.tiers[self._first_remote:]) + 5.0)

    async def _where_remote(self, pending: list[int], keys: list[str], where: list[int | None]) -> None:
        for ti in range(self._first_remote, len(self.tiers)):
            if not pending:
                return
            tier = self.tiers[ti]
            held = await self.guard.call(tier, "contains", lambda t=tier, b=[keys[i] for i in pending]:
                                         t.contains_many(b), None)
            pending = _mark(ti, pending, held, where)

    # ----------------------------------------------------------------- gets: a verified blob for each key
    def _found(self, keys: list[str], space: Space) -> list[_Found | None]:
        """Per key: its verified blob from the first tier that holds a good one, None when none does."""
        found: list[_Found | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for ti in range(self._first_remote):
            if not pending:
                break
            tier = self.tiers[ti]
            assert isinstance(tier, LocalTier)
            if isinstance(tier, GpuTier):  # verified as they entered: their kept headers, tensors on the device
                held = self.guard.call_now(tier, "get", lambda t=tier, b=[keys[i] for i in pending]:
                                           t.get_blobs_now(b))
                pending, bad = self._absorb(ti, pending, keys, found, space, held, self._held)
            else:
                values = self.guard.call_now(tier, "get", lambda t=tier, b=[keys[i] for i in pending]:
                                             t.get_many_now(b))
                pending, bad = self._absorb(ti, pending, keys, found, space, values, self._stored)
            for key in bad:
                with contextlib.suppress(Exception):
                    tier.delete_now(key)
        if pending and self._first_remote < len(self.tiers):
            self._run_remote(self._found_remote(pending, keys, found, space))
        return found

    async def _found_remote(self, pending: list[int], keys: list[str], found: list[_Found | None],
                            space: Space) -> None:
        for ti in range(self._first_remote, len(self.tiers)):
            if not pending:
                return
            tier = self.tiers[ti]
            values = await self.guard.call(tier, "get", lambda t=tier, b=[keys[i] for i in pending]:
                                           t.get_many(b), None)
            pending, bad = self._absorb(ti, pending, keys, found, space, values, self._stored)
            if bad and not tier.shared:
                await self.guard.call(tier, "delete", lambda t=tier, b=bad: t.delete_many(b), 0)
                self.stats.inc("quarantined_blobs", len(bad), tier=tier.name, space=space.space_id)
            elif bad:  # a reader of a shared tier: tell the producer
                await self.guard.call(tier, "report", lambda t=tier, b=bad: t.report_suspects(space.scope, b), None,
                                      health=False)
            if tier.expires:
                self._report_hits(tier, space, [keys[i] for i, f in enumerate(found)
                                                if f is not None and f.tier_index == ti])

    def _stored(self, key: str, value: bytes, space: Space, ti: int) -> _Found:
        """A blob's bytes as tier ``ti`` returned them, verified (:class:`BlobError` otherwise)."""
        blob = verify_blob(key, value, space, self.keyring, trusted=self.tiers[ti].local)
        return _Found(blob.meta, blob.payload, len(value), ti, value)

    def _held(self, key: str, held: DeviceBlob, space: Space, ti: int) -> _Found:
        """A GPU tier's entry (verified as it entered), its kept header checked against ``space``; its payload lent
        to the reader (kept from reuse until the reader's current stream has read it: :meth:`GpuTier.lend`)."""
        verify_held(held.meta, held.key_id, space, self.keyring)
        tier = self.tiers[ti]
        assert isinstance(tier, GpuTier)
        return _Found(held.meta, tier.lend(held), held.nbytes, ti, None)

    def _raw(self, ti: int, hits: list[tuple[str, _Found]]) -> list[tuple[str, bytes]]:
        """The bytes of tier ``ti``'s hits, to promote (a GPU tier's are read back: the copy a tier above needs)."""
        tier = self.tiers[ti]
        items: list[tuple[str, bytes]] = []
        for key, f in hits:
            raw = f.raw
            if raw is None and isinstance(tier, LocalTier):
                with contextlib.suppress(Exception):
                    raw = tier.get_now(key)
            if raw is not None:
                items.append((key, raw))
        return items

    def _absorb(self, ti: int, pending: list[int], keys: list[str], found: list[_Found | None], space: Space,
                values: Sequence[Any | None] | None, verify: Callable[[str, Any, Space, int], _Found]
                ) -> tuple[list[int], list[str]]:
        """Verify what tier ``ti`` returned (``verify(key, value, space, ti)``) into ``found``; return the
        still-missing indices and the keys of bad blobs (foreign ones are a miss, never bad: another generation
        may be right to hold them)."""
        if values is None:
            return pending, []
        tier = self.tiers[ti]
        still: list[int] = []
        bad: list[str] = []
        counts = {"corrupt_blobs": 0, "bad_signatures": 0, "foreign_blobs": 0}
        for i, value in zip(pending, values, strict=True):
            if value is None:
                still.append(i)
                continue
            try:
                found[i] = verify(keys[i], value, space, ti)
            except BlobError as exc:
                still.append(i)
                kind = ("foreign_blobs" if isinstance(exc, ForeignBlob) else
                        "bad_signatures" if isinstance(exc, SignatureError) else "corrupt_blobs")
                # a key this process does not hold is no evidence of damage: never deleted or reported for it
                # outside this process's memory (where a key rotated out ends what it signed)
                unknown_key = isinstance(exc, UnknownKey) and not tier.local
                counts[kind] += 1
                if kind != "foreign_blobs" and not unknown_key:
                    bad.append(keys[i])
                log.debug("%s: blob %s in tier %s: %s", kind, keys[i], tier.name, exc)
        for name, n in counts.items():
            if n:
                self.stats.inc(name, n, tier=tier.name, space=space.space_id)
        return still, bad

    # ----------------------------------------------------------------- after a hit
    def _report_hits(self, tier: Tier, space: Space, keys: list[str]) -> None:
        """Report verified hits in ``tier`` (its producer refreshes their TTL) without waiting for it."""
        if not keys:
            return
        task = asyncio.ensure_future(self.guard.call(tier, "report", lambda: tier.report_hits(space.scope, keys),
                                                     None, health=False))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def _promote(self, from_tier: int, items: list[tuple[str, bytes]], space_id: str) -> None:
        for ti in range(from_tier):
            tier = self.tiers[ti]
            if isinstance(tier, LocalTier):
                with contextlib.suppress(Exception):
                    tier.put_many_now(items)
            else:
                self.loop.loop.call_soon_threadsafe(self.write_behind.offer_nowait, tier.name, items, space_id)
            self.stats.inc("promotions", len(items), tier=tier.name, space=space_id)


def _mark(ti: int, pending: list[int], held: list[bool] | None, where: list[int | None]) -> list[int]:
    """Record tier ``ti`` for each pending key it holds; the indices still missing (all: no answer)."""
    if held is None:
        return pending
    still: list[int] = []
    for i, hit in zip(pending, held, strict=True):
        if hit:
            where[i] = ti
        else:
            still.append(i)
    return still
