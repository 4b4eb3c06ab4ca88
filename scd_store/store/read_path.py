"""The read path: walk the tiers fastest first, verify every blob, promote hits upward.

- A lookup's answer is the longest leading run of chunks present in any tier.
- A get verifies every blob (framing, checksum, bounds, the tag when the store holds signing
  keys, space generation and codec); a bad blob is a miss and is counted (``corrupt_blobs``,
  ``bad_signatures``, ``foreign_blobs``); the walk goes on to the next tier for it. Readers delete
  a bad blob only from this host's tiers (CPU, GPU, disk), never from a shared one (Redis, peers):
  there they report its key (``report_suspects``), and report their verified hits
  (``report_hits``) instead of refreshing a TTL themselves. The space's producer takes both in
  :meth:`ReadPath.repair`: it keeps only reported keys of its own space generation (the rest is
  ``refused_reports``), verifies each reported bad key itself, deletes what is bad (never a blob of
  another generation or codec: that is a miss, not damage) and rewrites it from its own tiers; what
  it has no copy of is then absent, so its engine stores it again. It refreshes the TTL of the
  reported hits (``ttl_refreshes``), so only blobs readers verified live on; the tier's TTL ends the
  rest. A report is removed only once it was processed: a tier failing midway leaves the rest for
  the next round.
- Local tiers (CPU, GPU) are read on the caller's thread; the rest on the store's event loop.
- Hits from a lower tier are copied into every tier above it (local tiers at once, remote ones
  through the write-behind, never blocking the reader).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scd_store.store.blob import Blob, BlobError, ForeignBlob, SignatureError, UnknownKey, decode_blob
from scd_store.store.guard import TierGuard
from scd_store.store.keys import KeyError_, parse_key
from scd_store.store.loop import LoopThread
from scd_store.store.records import Space
from scd_store.store.signing import Keyring
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


def _scope(space: Space) -> str:
    """Where a shared tier keeps the keys readers reported in ``space`` (its id and generation)."""
    return f"{space.space_id}:{space.generation}"


def leading_run(results: Sequence[Any]) -> int:
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

    # ----------------------------------------------------------------- operations
    def lookup(self, space: Space, keys: list[str], pair: str = "") -> PrefixHit:
        """The leading run of ``keys`` present in any tier (presence only: nothing is read or verified)."""
        t0 = time.perf_counter()
        where = self._walk(keys, "contains", space)
        run = leading_run(where)
        tiers = tuple(self.tiers[where[i]].name for i in range(run))
        self.stats.inc("lookups", space=space.space_id, pair=pair)
        self.stats.inc("miss_chunks", len(keys) - run, space=space.space_id, pair=pair)
        self.stats.observe("lookup", time.perf_counter() - t0)
        return PrefixHit(run, len(keys), tiers)

    def readable_by_others(self, space: Space, keys: list[str]) -> int:
        """The leading run of ``keys`` present in a tier other processes read (Redis, peers), presence only and
        not counted as a lookup: what a producer's consumers elsewhere can get. A shared tier that cannot
        answer counts as holding them (never store again on a guess); with no shared tier, every tier counts."""
        shared = [t for t in self.tiers if t.shared]
        if not shared:
            return leading_run(self._walk(keys, "contains", space))
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
    def _walk(self, keys: list[str], op: str, space: Space) -> list[Any]:
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
                           space: Space) -> None:
        for ti in range(start, len(self.tiers)):
            if not pending:
                return
            tier = self.tiers[ti]
            batch = [keys[i] for i in pending]
            fn = (lambda t=tier, b=batch: t.contains_many(b)) if op == "contains" else (
                lambda t=tier, b=batch: t.get_many(b))
            values = await self.guard.call(tier, op, fn, None)
            pending, bad = self._absorb(ti, pending, keys, results, op, space, values)
            if bad and not tier.shared:
                await self.guard.call(tier, "delete", lambda t=tier, b=bad: t.delete_many(b), 0)
                self.stats.inc("quarantined_blobs", len(bad), tier=tier.name, space=space.space_id)
            elif bad:  # a reader of a shared tier: tell the producer
                await self.guard.call(tier, "report", lambda t=tier, b=bad: t.report_suspects(_scope(space), b), None,
                                      health=False)
            if tier.expires and op == "get":
                self._report_hits(tier, space, [keys[i] for i, f in enumerate(results)
                                                if isinstance(f, _Found) and f.tier_index == ti])

    def _report_hits(self, tier: Tier, space: Space, keys: list[str]) -> None:
        """Report verified hits in ``tier`` (its producer refreshes their TTL) without waiting for it."""
        if not keys:
            return
        task = asyncio.ensure_future(self.guard.call(tier, "report", lambda: tier.report_hits(_scope(space), keys),
                                                     None, health=False))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def repair(self, space: Space, limit: int = 256, hits_limit: int = 4096) -> tuple[int, int]:
        """A producer's round over each shared tier: up to ``limit`` keys readers reported bad (verified
        here, deleted when bad, rewritten from a good copy in this host's tiers), then up to ``hits_limit``
        reported hits (their TTL refreshed). Returns ``(quarantined, repaired)``."""
        quarantined = repaired = 0
        for ti, tier in enumerate(self.tiers):
            if not tier.shared:
                continue
            q, r, bad = await self._repair_suspects(ti, tier, space, limit)
            quarantined, repaired = quarantined + q, repaired + r
            if tier.expires:
                await self._refresh_hits(tier, space, hits_limit, bad)
        return quarantined, repaired

    def _own(self, tier: Tier, space: Space, reported: list[str]) -> tuple[list[str], list[str]]:
        """Split reported keys into those of ``space``'s generation and the rest (counted as refused)."""
        mine: list[str] = []
        refused: list[str] = []
        for key in reported:
            try:
                ok = parse_key(key)[:2] == (space.space_id, space.generation)
            except KeyError_:
                ok = False
            (mine if ok else refused).append(key)
        if refused:
            self.stats.inc("refused_reports", len(refused), tier=tier.name, space=space.space_id)
            log.debug("refused %d reported keys in tier %s outside %s", len(refused), tier.name, _scope(space))
        return mine, refused

    async def _repair_suspects(self, ti: int, tier: Tier, space: Space, limit: int) -> tuple[int, int, set[str]]:
        scope = _scope(space)
        reported = await self.guard.call(tier, "suspects", lambda: tier.reports("suspects", scope, limit), None)
        if not reported:
            return 0, 0, set()
        mine, done = self._own(tier, space, reported)
        quarantined = repaired = 0
        bad: list[str] = []
        values = await self.guard.call(tier, "get", lambda: tier.get_many(mine), None) if mine else None
        if values is not None:
            absent: list[str] = []
            for key, value in zip(mine, values, strict=True):
                state = "absent" if value is None else self._state(key, value, space)
                if state == "bad":
                    bad.append(key)
                elif state == "absent":
                    absent.append(key)
                else:  # intact (a false report, or repaired already) or foreign: left alone
                    done.append(key)
            deleted = not bad or await self.guard.call(tier, "delete", lambda: tier.delete_many(bad), None) is not None
            if bad and deleted:
                quarantined = len(bad)
                self.stats.inc("quarantined_blobs", quarantined, tier=tier.name, space=space.space_id)
            # what this round deleted, or an earlier one deleted and could not rewrite: from a good copy here
            fixable = [*(bad if deleted else []), *absent]
            fixes = await self._good_copies(space, ti, fixable) if fixable else []
            if not fixes or await self.guard.call(tier, "put", lambda: tier.put_many(fixes), False, True):
                repaired = len(fixes)
                done += fixable
        if repaired:
            self.stats.inc("repaired_blobs", repaired, tier=tier.name, space=space.space_id)
        if done:  # only what was processed: the rest is taken again next round
            await self.guard.call(tier, "report", lambda: tier.clear_reports("suspects", scope, done), None)
        return quarantined, repaired, set(bad)

    async def _refresh_hits(self, tier: Tier, space: Space, limit: int, bad: set[str]) -> None:
        """Refresh the TTL of reported hits of ``space`` (never of a blob this round found bad)."""
        scope = _scope(space)
        reported = await self.guard.call(tier, "hits", lambda: tier.reports("hits", scope, limit), None)
        if not reported:
            return
        mine, refused = self._own(tier, space, reported)
        mine = [k for k in mine if k not in bad]
        refreshed = await self.guard.call(tier, "touch", lambda: tier.touch_many(mine), None) if mine else 0
        if refreshed:
            self.stats.inc("ttl_refreshes", refreshed, tier=tier.name, space=space.space_id)
        done = refused if refreshed is None else reported  # a failed refresh keeps its reports for next round
        if done:
            await self.guard.call(tier, "report", lambda: tier.clear_reports("hits", scope, done), None)

    def _state(self, key: str, value: bytes, space: Space) -> str:
        """``intact``, ``foreign`` (another generation's or codec's blob: a miss, not damage), ``unknown_key`` (signed
        with a key this process does not hold, or no longer: no evidence of damage) or ``bad``."""
        try:
            self._verify(key, value, space)
        except ForeignBlob:
            return "foreign"
        except UnknownKey:
            return "unknown_key"
        except BlobError:
            return "bad"
        return "intact"

    def _intact(self, key: str, value: bytes, space: Space) -> bool:
        return self._state(key, value, space) == "intact"

    async def _good_copies(self, space: Space, below: int, keys: list[str]) -> list[tuple[str, bytes]]:
        """Verified copies of ``keys`` from this host's tiers above tier ``below``."""
        fixes: dict[str, bytes] = {}
        for tier in self.tiers[:below]:
            wanted = [k for k in keys if k not in fixes]
            if tier.shared or not wanted:
                continue
            values = await self.guard.call(tier, "get", lambda t=tier, w=wanted: t.get_many(w), None) or []
            fixes.update({k: v for k, v in zip(wanted, values, strict=False)
                          if v is not None and self._intact(k, v, space)})
        return list(fixes.items())

    def _verify(self, key: str, value: bytes, space: Space, trusted: bool = False) -> Blob:
        """Every check of a blob; ``trusted`` (this process's memory tiers, which hold only blobs it wrote
        or verified before promoting them) skips the signature's arithmetic, not the checksum, nor the check that
        its key is still held (a key rotated out or removed ends what it signed in memory too)."""
        return decode_blob(value, key=key, space_id=space.space_id, keyring=self.keyring, verified_before=trusted,
                           expect_space_fingerprint=space.fingerprint, max_token_count=space.chunk_size)

    def _absorb(self, ti: int, pending: list[int], keys: list[str], results: list[Any], op: str,
                space: Space, values: list[Any] | None) -> tuple[list[int], list[str]]:
        """Record what tier ``ti`` returned; return the still-missing indices and the keys of bad blobs
        (foreign ones are a miss, never bad: another generation may be right to hold them)."""
        if values is None:
            return pending, []
        still: list[int] = []
        bad: list[str] = []
        counts = {"corrupt_blobs": 0, "bad_signatures": 0, "foreign_blobs": 0}
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
                blob = self._verify(keys[i], value, space, trusted=self.tiers[ti].local)
            except BlobError as exc:
                still.append(i)
                kind = ("foreign_blobs" if isinstance(exc, ForeignBlob) else
                        "bad_signatures" if isinstance(exc, SignatureError) else "corrupt_blobs")
                # a key this process does not hold is no evidence of damage: never deleted or reported for it
                # outside this process's memory (where a key rotated out ends what it signed)
                unknown_key = isinstance(exc, UnknownKey) and not self.tiers[ti].local
                counts[kind] += 1
                if kind != "foreign_blobs" and not unknown_key:
                    bad.append(keys[i])
                log.debug("%s: blob %s in tier %s: %s", kind, keys[i], self.tiers[ti].name, exc)
                continue
            results[i] = _Found(blob, value, ti)
        for name, n in counts.items():
            if n:
                self.stats.inc(name, n, tier=self.tiers[ti].name, space=space.space_id)
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
