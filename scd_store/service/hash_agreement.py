"""Producers and consumers must compute the same chunk hashes, or consumers never hit, silently.

Each engine adapter derives a :class:`HashCanary` from its engine, the way the engine itself hashes:
the hash of a fixed two-chunk token sequence, the chunk (page) size and the settings that hashing
depends on. A space's producer records its canary in the registry; a consumer compares its own with
its producer's (:class:`HashAgreement`). A difference is loud: :class:`HashMismatch` at start-up naming
the settings to fix, the ``hash_mismatch`` counter, and no lookups answered (they could only ever
miss). A consumer that starts before its producer checks again on its lookups (at most every
``recheck_s``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from importlib import metadata as package_metadata

from scd_store.service.bindings import Binding, Role
from scd_store.service.settings import SettingsError
from scd_store.store.registry import Registry
from scd_store.store.stats import StoreStats

log = logging.getLogger("scd_store.service")
DOCS = "docs/engines.md#hash-agreement"


def package_version(*names: str) -> str:
    """The installed version of the first of ``names`` present, for a canary's settings; "(absent)" if none is."""
    for name in names:
        try:
            return package_metadata.version(name)
        except package_metadata.PackageNotFoundError:
            continue
    return "(absent)"


def canary_tokens(chunk_size: int) -> list[int]:
    """The fixed token sequence (two chunks) every canary hashes."""
    return [(i * 2654435761 + 12345) % 32000 for i in range(2 * chunk_size)]


class HashMismatch(SettingsError):  # noqa: N818 - the name says what happened
    """This engine hashes chunks differently from its space's producer."""


@dataclass(frozen=True, slots=True)
class HashCanary:
    """How one engine process hashes chunks: ``value`` of the canary tokens, and what it depends on."""

    engine: str
    chunk_size: int
    value: str
    settings: dict[str, str] = field(default_factory=dict)

    def record(self, producer: str) -> dict:
        return {"engine": self.engine, "chunk_size": self.chunk_size, "value": self.value,
                "settings": dict(self.settings), "producer": producer}


def mismatch_message(space_id: str, mine: HashCanary, theirs: dict) -> str | None:
    """Why ``mine`` cannot find what the producer recorded as ``theirs`` (None when they agree)."""
    same = (theirs.get("engine"), theirs.get("value"), theirs.get("chunk_size"))
    if same == (mine.engine, mine.value, mine.chunk_size):
        return None
    where = f"space {space_id!r} (producer {theirs.get('producer')!r})"
    if theirs.get("engine") != mine.engine:
        return (f"this engine ({mine.engine}) computes other chunk keys than the producer of {where}, which stores "
                f"through {theirs.get('engine')}: run the space's producer and consumers on the same engine")
    diffs = []
    if theirs.get("chunk_size") != mine.chunk_size:
        diffs.append(f"chunk size: producer {theirs.get('chunk_size')}, here {mine.chunk_size}")
    ours = dict(mine.settings)
    for name in sorted(set(ours) | set(theirs.get("settings", {}))):
        a, b = theirs.get("settings", {}).get(name, "(unset)"), ours.get(name, "(unset)")
        if a != b:
            diffs.append(f"{name}: producer {a!r}, here {b!r}")
    if not diffs:
        diffs.append("the settings agree, so the hash seed is random per process: set PYTHONHASHSEED to one value in "
                     "every process (or use a sha256 hash algorithm)")
    return (f"this engine's chunk hashes differ from those of {where}, so it would never find the space's codes. "
            f"Fix: {'; '.join(diffs)} (see {DOCS})")


class HashAgreement:
    """Records producers' canaries and checks consumers' against them."""

    def __init__(self, registry: Registry, stats: StoreStats, *, recheck_s: float = 5.0) -> None:
        self.registry = registry
        self.stats = stats
        self.recheck_s = recheck_s
        self._pending: dict[str, tuple[HashCanary, float]] = {}  # consumer model -> its canary, last check
        self._failed: set[str] = set()
        self._message = ""

    def check(self, binding: Binding, canary: HashCanary) -> None:
        """A producer records ``canary``; a consumer compares it (raising :class:`HashMismatch`), or,
        when its producer has recorded none yet, checks again on its lookups."""
        space_id = binding.space.space_id
        if binding.role == Role.PRODUCER:
            self.registry.record_canary(space_id, canary.engine, canary.record(binding.model))
            return
        self._pending[binding.model] = (canary, 0.0)
        if not self.ok(binding):
            raise HashMismatch(self._message)

    def ok(self, binding: Binding) -> bool:
        """False when this consumer is known to hash differently from its producer (counted once)."""
        if binding.model in self._failed:
            return False
        pending = self._pending.get(binding.model)
        if pending is None:
            return True
        canary, last = pending
        now = time.monotonic()
        if now - last < self.recheck_s:
            return True
        self._pending[binding.model] = (canary, now)
        recorded = self.registry.canaries(binding.space.space_id)
        if not recorded:
            return True  # the producer has not started yet: check again later
        theirs = recorded.get(canary.engine) or next(iter(recorded.values()))
        message = mismatch_message(binding.space.space_id, canary, theirs)
        del self._pending[binding.model]
        if message is None:
            return True
        self._failed.add(binding.model)
        self._message = message
        self.stats.inc("hash_mismatch", space=binding.space.space_id, pair=binding.pair_id)
        log.error("scd-store: %s", message)
        return False
