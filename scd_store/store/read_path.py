"""The read path: walk the tiers fastest first, verify every blob, promote hits upward.

- A lookup's answer is the longest leading run of chunks present in any tier.
- A get verifies every blob (checksum, version, space fingerprint); a bad blob is a miss, is
  deleted from the tier that held it and is counted (``corrupt_blobs``); the walk goes on to the
  next tier for it.
- Local tiers (CPU, GPU) are read on the caller's thread; the rest on the store's event loop.
- Hits from a lower tier are copied into every tier above it (local tiers at once, remote ones
  through the write-behind, never blocking the reader).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scd_store.store.blob import Blob, BlobError, decode_blob
from scd_store.store.guard import TierGuard
from scd_store.store.loop import LoopThread
from scd_store.store.registry import Space
from scd_store.store.stats import StoreStats
from scd_store.store.tiers.base import LocalTier, Tier
from scd_store.store.views import CodeChunk, PrefixHit
from scd_store.store.write_behind import WriteBehind

log = logging.getLogger("scd_store.store")


@dataclass(slots=True)
class _Found:
    blob: Blob
    raw: bytes
    tier_index: int


def leading_run(results: Sequence[Any]) -> int:
    """How many leading entries of ``results`` are not None."""
    for i, r in enumerate(results):
        if r is None:
            return i
    return len(results)


class ReadPath:
    """Lookups and verified gets of store keys over ``tiers`` (fastest first)."""

    def __init__(self, tiers: Sequence[Tier], guard: TierGuard, stats: StoreStats, loop: LoopThread,
                 write_behind: WriteBehind) -> None:
        self.tiers = list(tiers)
        self.guard = guard
        self.stats = stats
        self.loop = loop
        self.write_behind = write_behind

    # ----------------------------------------------------------------- operations
    def lookup(self, space_id: str, keys: list[str], pair: str = "") -> PrefixHit:
        """The leading run of ``keys`` present in any tier (presence only: nothing is read or verified)."""
        t0 = time.perf_counter()
        where = self._walk(keys, "contains", None)
        run = leading_run(where)
        tiers = tuple(self.tiers[where[i]].name for i in range(run))
        self.stats.inc("lookups", space=space_id, pair=pair)
        self.stats.inc("miss_chunks", len(keys) - run, space=space_id, pair=pair)
        self.stats.observe("lookup", time.perf_counter() - t0)
        return PrefixHit(run, len(keys), tiers)

    def get(self, space: Space, keys: list[str], pair_id: str) -> list[CodeChunk]:
        """The verified leading run of ``keys`` in ``space``; hits are counted per tier and promoted."""
        t0 = time.perf_counter()
        found = self._walk(keys, "get", space)
        run = leading_run(found)
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

    # ----------------------------------------------------------------- the walk
    def _walk(self, keys: list[str], op: str, space: Space | None) -> list[Any]:
        """Per key: the tier index that has it (``contains``) or a ``_Found`` (``get``); None when absent."""
        results: list[Any] = [None] * len(keys)
        pending = list(range(len(keys)))
        first_remote = next((i for i, t in enumerate(self.tiers) if not t.local), len(self.tiers))
        for ti in range(first_remote):
            if not pending:
                break
            tier = self.tiers[ti]
            assert isinstance(tier, LocalTier)
            batch = [keys[i] for i in pending]
            values = self.guard.call_now(tier, op, (lambda t=tier, b=batch: t.contains_many_now(b))
                                         if op == "contains" else (lambda t=tier, b=batch: t.get_many_now(b)))
            pending, bad = self._absorb(ti, pending, keys, results, op, space, values)
            for key in bad:
                with contextlib.suppress(Exception):
                    tier.delete_now(key)
        if pending and first_remote < len(self.tiers):
            self.loop.run(self._walk_remote(first_remote, pending, keys, results, op, space),
                          timeout=self.guard.deadline(self.tiers[first_remote:]) + 5.0)
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
            values = await self.guard.call(tier, op, fn, None)
            pending, bad = self._absorb(ti, pending, keys, results, op, space, values)
            if bad:
                await self.guard.call(tier, "delete", lambda t=tier, b=bad: t.delete_many(b), 0)

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

    def _promote(self, from_tier: int, items: list[tuple[str, bytes]], space_id: str) -> None:
        for ti in range(from_tier):
            tier = self.tiers[ti]
            if isinstance(tier, LocalTier):
                with contextlib.suppress(Exception):
                    tier.put_many_now(items)
            else:
                self.loop.loop.call_soon_threadsafe(self.write_behind.offer_nowait, tier.name, items, space_id)
            self.stats.inc("promotions", len(items), tier=tier.name, space=space_id)
