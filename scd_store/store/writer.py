"""The store's write: code blobs signed and framed, the top tier written on the caller's thread, every lower
tier handed to the write-behind (:class:`StoreWriter`, the write face a
:class:`~scd_store.store.views.ProducerView` holds)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from scd_store.store.births import Births
from scd_store.store.blob import BlobMeta, encode_blob
from scd_store.store.guard import TierGuard
from scd_store.store.keyring import Keyring
from scd_store.store.log_once import Incidents
from scd_store.store.loop import LoopThread
from scd_store.store.records import Space
from scd_store.store.stats import StoreStats
from scd_store.store.tiers.base import LocalTier, Tier
from scd_store.store.write_behind import WriteBehind

log = logging.getLogger("scd_store.store")


class StoreWriter:
    """Writes blobs into ``tiers``: the top one now, the lower ones through ``write_behind``."""

    def __init__(self, tiers: Sequence[Tier], guard: TierGuard, stats: StoreStats, loop: LoopThread,
                 write_behind: WriteBehind, *, keyring: Keyring | None, put_timeout_s: float,
                 births: Births | None = None) -> None:
        self.tiers = list(tiers)
        self.guard = guard
        self.stats = stats
        self.loop = loop
        self.write_behind = write_behind
        self.keyring = keyring
        self.put_timeout_s = put_timeout_s
        self.births = births if births is not None else Births()  # what this producer wrote, and when
        self._incidents = Incidents(stats, log)

    def write(self, space: Space, keys: Sequence[str], payloads: Sequence[bytes], token_counts: Sequence[int],
              codec_id: str) -> list[str]:
        """Blobs for ``payloads`` under ``keys``: the top tier now, the lower ones through the write-behind.

        Called by :class:`~scd_store.store.views.ProducerView` (whose space the registry authorised); returns the
        keys the top tier holds now. Every blob not returned is counted: ``unsigned_puts`` (no key),
        ``oversized_writes`` (over a tier's ``max_value_bytes``), or ``dropped_writes`` / ``lost_writes`` (the top
        tier failed)."""
        t0 = time.perf_counter()
        if not len(keys) == len(payloads) == len(token_counts):
            raise ValueError(f"{len(keys)} keys, {len(payloads)} payloads and {len(token_counts)} token counts "
                             "must match")
        signer = None
        if self.keyring is not None:
            signer = self.keyring.signer(space.space_id)
            if signer is None:
                self._incidents.count("unsigned_puts", "scd-store: the keyring holds no valid private key for space "
                                      "%s: not storing its codes (counted as unsigned_puts; logged once)",
                                      space.space_id, n=len(keys), once=f"unsigned:{space.space_id}",
                                      space=space.space_id)
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
            self.loop.run(self.write_behind.enqueue(items, space.space_id), timeout=self.put_timeout_s + 5.0)
        self.births.wrote(stored)
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
                self.guard.health[top.name].succeeded()
                ok = True
            except Exception as exc:
                self.guard.failed(top, exc)
                ok = False
        else:
            ok = self.loop.run(self.guard.call(top, "put", lambda: top.put_many(items), False, success=True),
                               timeout=self.guard.timeouts[top.name] + 5.0)
        if not ok:  # nothing above it to re-sync from
            self.stats.inc("dropped_writes", len(items), tier=top.name, space=space_id)
            self.stats.inc("lost_writes", len(items), tier=top.name, space=space_id)
            return []
        self.stats.inc("bytes_written", sum(len(v) for _, v in items), tier=top.name, space=space_id)
        return [k for k, _ in items]

    def oversized(self, tier: Tier, count: int, space_id: str) -> None:
        """Count blobs larger than ``tier`` takes (``oversized_writes``; logged once per tier)."""
        self._incidents.count("oversized_writes", "scd-store: blobs larger than tier %s's max_value_bytes (%s) are "
                              "not written there (counted as oversized_writes; logged once)", tier.name,
                              tier.max_value_bytes, n=count, once=f"oversized:{tier.name}", tier=tier.name,
                              space=space_id)
