"""The producer's repair of the shared tiers: what readers reported there, taken and acted on.

Readers never delete from a shared tier (Redis, peers) nor refresh a TTL there: they report bad keys
(``report_suspects``) and verified hits (``report_hits``). The space's producer takes both in each round of
:class:`ProducerRepair`: it keeps only reported keys of its own space generation (the rest is
``refused_reports``), verifies each reported bad key itself, deletes what is bad (never a blob of another
generation or codec: that is a miss, not damage) and rewrites it from its own tiers; what it has no copy of
is then absent, so its engine stores it again. It refreshes the TTL of the reported hits
(``ttl_refreshes``), so only blobs readers verified live on; the tier's TTL ends the rest. A report is
removed only once it was processed: a tier failing midway leaves the rest for the next round. Rounds run
every ``repair_s`` over every space the store writes (:meth:`ProducerRepair.run`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence

from scd_store.store.guard import TierGuard
from scd_store.store.keyring import Keyring
from scd_store.store.keys import KeyError_, parse_key
from scd_store.store.records import Space
from scd_store.store.stats import StoreStats
from scd_store.store.tiers.base import Tier
from scd_store.store.verify import blob_state

log = logging.getLogger("scd_store.store")


class ProducerRepair:
    """Rounds over ``tiers``' shared ones for every space ``spaces()`` names (the spaces this store writes)."""

    def __init__(self, tiers: Sequence[Tier], guard: TierGuard, stats: StoreStats, keyring: Keyring | None,
                 spaces: Callable[[], Iterable[Space]]) -> None:
        self.tiers = list(tiers)
        self.guard = guard
        self.stats = stats
        self.keyring = keyring
        self.spaces = spaces

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
        """One round over each shared tier: up to ``limit`` keys readers reported bad (verified here, deleted
        when bad, rewritten from a good copy in this host's tiers), then up to ``hits_limit`` reported hits
        (their TTL refreshed). Returns ``(quarantined, repaired)``."""
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
        if refused:
            self.stats.inc("refused_reports", len(refused), tier=tier.name, space=space.space_id)
            log.debug("refused %d reported keys in tier %s outside %s", len(refused), tier.name, space.scope)
        return mine, refused

    async def _suspects(self, ti: int, tier: Tier, space: Space, limit: int) -> tuple[int, int, set[str]]:
        """Verify, quarantine and rewrite the keys readers reported bad in tier ``ti``."""
        scope = space.scope
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
                state = "absent" if value is None else blob_state(key, value, space, self.keyring)
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
            if not fixes or await self.guard.call(tier, "put", lambda: tier.put_many(fixes), False, success=True):
                repaired = len(fixes)
                done += fixable
        if repaired:
            self.stats.inc("repaired_blobs", repaired, tier=tier.name, space=space.space_id)
        if done:  # only what was processed: the rest is taken again next round
            await self.guard.call(tier, "report", lambda: tier.clear_reports("suspects", scope, done), None)
        return quarantined, repaired, set(bad)

    async def _hits(self, tier: Tier, space: Space, limit: int, bad: set[str]) -> None:
        """Refresh the TTL of reported hits of ``space`` (never of a blob this round found bad)."""
        scope = space.scope
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
