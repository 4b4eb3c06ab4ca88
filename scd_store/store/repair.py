"""The producer's repair of the shared tiers: what readers reported there, checked against what the producer can
verify itself, and acted on within bounds readers cannot move.

Readers never delete from a shared tier (Redis, peers) nor refresh a TTL there: they report bad keys
(``report_suspects``) and verified hits (``report_hits``). The space's producer takes both in each round of
:class:`ProducerRepair`: it keeps only reported keys of its own space generation (the rest is
``refused_reports``) and trusts none of them:

- **Suspects.** It reads each reported key itself: a blob that is there and bad is deleted
  (``quarantined_blobs``) and rewritten from a verified copy in its own tiers (``repaired_blobs``); a blob
  that is intact (a false report: ``false_reports``; not read again for 10 s, however often reported) or
  another generation's is left alone; a key that is not there is no damage (evicted, expired): a report of it
  is refused, and only a key this producer deleted itself and could not rewrite yet (nor wrote since) is
  written again. A round reads at most :data:`VERIFY_BYTES` of reported blobs and checks them off the store's
  loop; rewrites spend a budget of ``rewrite_rate`` per second (the rest wait for a later round:
  ``deferred_repairs``) and a key is rewritten at most once a minute
  (:mod:`~scd_store.store.repair_budget`).
- **Hits.** It refreshes the TTL of a reported hit only for a blob it wrote itself (its
  :class:`~scd_store.store.births.Births`), at most once per quarter TTL, and never past the tier's
  ``max_lifetime`` counted from when it wrote the blob (``refused_refreshes`` otherwise): however readers
  report, an unused blob expires within its lifetime.

A report is removed only once it was processed: a tier failing midway leaves the rest for the next round.
Rounds run every ``repair_s`` over every space the store writes (:meth:`ProducerRepair.run`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence

from scd_store.store.births import Births
from scd_store.store.guard import TierGuard
from scd_store.store.keyring import Keyring
from scd_store.store.keys import KeyError_, parse_key
from scd_store.store.records import Space
from scd_store.store.repair_budget import RecentlyIntact, RewriteBudget
from scd_store.store.stats import StoreStats
from scd_store.store.tiers.base import Tier
from scd_store.store.verify import blob_state

log = logging.getLogger("scd_store.store")
VERIFY_BYTES = 16 << 20  # reported blobs a round reads and verifies, in bytes (the rest wait for a later round)
VERIFY_BATCH = 32  # reported keys read per tier call


class ProducerRepair:
    """Rounds over ``tiers``' shared ones for every space ``spaces()`` names (the spaces this store writes)."""

    def __init__(self, tiers: Sequence[Tier], guard: TierGuard, stats: StoreStats, keyring: Keyring | None,
                 spaces: Callable[[], Iterable[Space]], births: Births, rewrite_rate: float) -> None:
        self.tiers = list(tiers)
        self.guard = guard
        self.stats = stats
        self.keyring = keyring
        self.spaces = spaces
        self.births = births
        self.budget = RewriteBudget(rewrite_rate)
        self.intact = RecentlyIntact()  # reported keys found intact: not read again for a while

    async def run(self, every_s: float) -> None:
        """A round over every space each ``every_s`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.all_spaces()
            except Exception as exc:  # noqa: BLE001 - a failing round is retried next time
                log.debug("repair round failed: %s", exc)

    async def all_spaces(self) -> tuple[int, int]:
        """One round over every space: ``(quarantined, repaired)`` blobs in all."""
        quarantined = repaired = 0
        for space in set(self.spaces()):
            q, r = await self.round(space)
            quarantined, repaired = quarantined + q, repaired + r
        return quarantined, repaired

    async def round(self, space: Space, limit: int = 256, hits_limit: int = 4096) -> tuple[int, int]:
        """One round over each shared tier: up to ``limit`` keys readers reported bad, then up to ``hits_limit``
        reported hits. Returns ``(quarantined, repaired)``."""
        quarantined = repaired = 0
        for ti, tier in enumerate(self.tiers):
            if not tier.shared:
                continue
            q, r, bad = await self._suspects(ti, tier, space, limit)
            quarantined, repaired = quarantined + q, repaired + r
            if tier.expires:
                await self._hits(tier, space, hits_limit, bad)
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
        self._refused(tier, space, len(refused))
        return mine, refused

    def _refused(self, tier: Tier, space: Space, n: int) -> None:
        if n:
            self.stats.inc("refused_reports", n, tier=tier.name, space=space.space_id)

    async def _suspects(self, ti: int, tier: Tier, space: Space, limit: int) -> tuple[int, int, set[str]]:
        """Verify, quarantine and rewrite (within the budgets) the keys readers reported bad in tier ``ti``."""
        scope = space.scope
        reported = await self.guard.call(tier, "suspects", lambda: tier.reports("suspects", scope, limit), None)
        if not reported:
            return 0, 0, set()
        mine, done = self._own(tier, space, reported)
        known = [k for k in mine if k in self.intact]  # found intact lately: not read again on a reader's word
        self._false(tier, space, len(known))
        done += known
        read, values = await self._read(tier, [k for k in mine if k not in self.intact])
        quarantined = repaired = 0
        bad: list[str] = []
        if values is not None:
            owed: list[str] = []
            states = await asyncio.to_thread(self._states, space, read, values)  # signatures: off the store's loop
            for key, state in zip(read, states, strict=True):
                if state == "bad":
                    bad.append(key)
                elif state == "absent" and self.budget.owes(key, self.births):
                    owed.append(key)  # deleted by this producer earlier, its rewrite still owed
                else:  # intact (a false report), foreign, or absent (no damage: evicted or expired)
                    done.append(key)
                    if state == "absent":
                        self._refused(tier, space, 1)
                    elif state == "intact":
                        self.intact.add(key)
                        self._false(tier, space, 1)
            deleted = not bad or await self.guard.call(tier, "delete", lambda: tier.delete_many(bad), None) is not None
            if bad and deleted:
                quarantined = len(bad)
                self.budget.owe(bad)
                self.stats.inc("quarantined_blobs", quarantined, tier=tier.name, space=space.space_id)
            allowed, deferred = self.budget.take([*(bad if deleted else []), *owed])
            if deferred:
                self.stats.inc("deferred_repairs", len(deferred), tier=tier.name, space=space.space_id)
            fixes = await self._good_copies(space, ti, allowed) if allowed else []
            if not fixes or await self.guard.call(tier, "put", lambda: tier.put_many(fixes), False, success=True):
                repaired = len(fixes)
                self.budget.done(k for k, _ in fixes)
                self.births.wrote(k for k, _ in fixes)
                done += allowed  # rewritten, or no good copy here (its engine stores the chunk again)
        if repaired:
            self.stats.inc("repaired_blobs", repaired, tier=tier.name, space=space.space_id)
        if done:  # only what was processed: the rest is taken again next round
            await self.guard.call(tier, "report", lambda: tier.clear_reports("suspects", scope, done), None)
        return quarantined, repaired, set(bad)

    async def _read(self, tier: Tier, keys: list[str]) -> tuple[list[str], list[bytes | None] | None]:
        """The reported ``keys`` read in batches until :data:`VERIFY_BYTES` are spent (the rest wait for a later
        round): the keys read and their values; None values when the tier failed."""
        read: list[str] = []
        values: list[bytes | None] = []
        spent = 0
        for i in range(0, len(keys), VERIFY_BATCH):
            if spent >= VERIFY_BYTES:
                break
            batch = keys[i:i + VERIFY_BATCH]
            got = await self.guard.call(tier, "get", lambda b=batch: tier.get_many(b), None)
            if got is None:
                return read, (values if read else None)
            read += batch
            values += got
            spent += sum(len(v) for v in got if v is not None)
        return read, values

    def _states(self, space: Space, keys: list[str], values: list[bytes | None]) -> list[str]:
        return ["absent" if value is None else blob_state(key, value, space, self.keyring)
                for key, value in zip(keys, values, strict=True)]

    def _false(self, tier: Tier, space: Space, n: int) -> None:
        if n:
            self.stats.inc("false_reports", n, tier=tier.name, space=space.space_id)

    async def _hits(self, tier: Tier, space: Space, limit: int, bad: set[str]) -> None:
        """Refresh the TTL of reported hits of ``space`` that this producer wrote itself, within their lifetime
        (never of a blob this round found bad)."""
        scope = space.scope
        reported = await self.guard.call(tier, "hits", lambda: tier.reports("hits", scope, limit), None)
        if not reported:
            return
        mine, refused = self._own(tier, space, reported)
        ttl_ms = getattr(tier, "ttl_ms", None) or 0  # a tier that expires says its TTL and blobs' longest life
        lifetime = getattr(tier, "max_lifetime_ms", None)
        keys: list[str] = []
        ttls: list[int] = []
        unknown = 0
        for key in mine:
            ttl = None if key in bad or not ttl_ms else self.births.ttl_for(key, ttl_ms, lifetime, ttl_ms // 4)
            if ttl is None:
                unknown += 1
            elif ttl > 0:
                keys.append(key)
                ttls.append(ttl)
        if unknown:
            self.stats.inc("refused_refreshes", unknown, tier=tier.name, space=space.space_id)
        refreshed = await self.guard.call(tier, "touch", lambda: tier.touch_many(keys, ttls), None) if keys else 0
        if refreshed:
            self.stats.inc("ttl_refreshes", refreshed, tier=tier.name, space=space.space_id)
        done = refused if refreshed is None else reported  # a failed refresh keeps its reports for next round
        if done:
            await self.guard.call(tier, "report", lambda: tier.clear_reports("hits", scope, done), None)

    async def _good_copies(self, space: Space, below: int, keys: list[str]) -> list[tuple[str, bytes]]:
        """Verified copies of ``keys`` from this host's tiers above tier ``below``."""
        fixes: dict[str, bytes] = {}
        for tier in self.tiers[:below]:
            wanted = [k for k in keys if k not in fixes]
            if tier.shared or not wanted:
                continue
            values = await self.guard.call(tier, "get", lambda t=tier, w=wanted: t.get_many(w), None) or []
            fixes.update({k: v for k, v in zip(wanted, values, strict=False)
                          if v is not None and blob_state(k, v, space, self.keyring) == "intact"})
        return list(fixes.items())
