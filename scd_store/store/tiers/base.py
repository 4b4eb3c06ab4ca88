"""The tier interface: a small ABC with batched operations that default to loops.

Every tier is async (it runs on the store's event loop). A :class:`LocalTier` (CPU, GPU) is also
callable synchronously from any thread through its ``*_now`` methods, so a lookup that hits only
local tiers never crosses threads.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scd_store.errors import ScdStoreError
from scd_store.store.log_once import Incidents
from scd_store.store.tiers.lru import ByteLRU

if TYPE_CHECKING:
    from scd_store.store.keyring import Keyring

EvictListener = Callable[[str, str, int], None]  # (tier name, key, bytes)
Produces = Callable[[str], bool]  # whether this process produces a space (by id): only those are published
# (counter name, amount[, space=space id]): the store's stats, labelled with this tier (and the space when given)
Counter = Callable[..., None]


class TierError(ScdStoreError, RuntimeError):
    """A tier could not serve a request (connection lost, I/O error, bad configuration)."""


@dataclass(frozen=True, slots=True)
class TierUsage:
    """How full a tier is. ``capacity_bytes`` is None when the tier does not bound it itself."""

    items: int
    bytes_used: int
    capacity_bytes: int | None


class Tier(ABC):
    """One level of the store. Values are opaque bytes (code blobs); keys are store keys."""

    kind: str = "tier"
    local: bool = False
    shared: bool = False  # other hosts' processes read it (Redis, peers): readers never delete there
    expires: bool = False  # blobs have a TTL that verified hits refresh (report_hits, then touch_many)
    max_value_bytes: int | None = None  # the largest blob the tier stores (None: no bound of its own)

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.kind
        self._on_evict: EvictListener | None = None
        self._counter: Counter | None = None
        self.keyring: Keyring | None = None
        self.produces: Produces = _every_space

    def attach(self, *, keyring: Keyring | None, count: Counter | None, produces: Produces | None = None) -> None:
        """Called by the store before :meth:`start`: its keyring (for a tier that signs what it publishes or
        verifies what it is told), where the tier's own counters go (``count(name, amount)``) and which spaces
        this process produces (a tier that publishes to others publishes those only; None: every space)."""
        self.keyring = keyring
        self._counter = count
        self.produces = produces if produces is not None else _every_space

    def _count(self, counter: str, amount: int = 1, *, space: str = "") -> None:
        """Add to one of the store's counters (:data:`scd_store.store.stats.COUNTERS`) under this tier (and
        ``space``, when given)."""
        if self._counter is not None and amount:
            if space:
                self._counter(counter, amount, space=space)
            else:
                self._counter(counter, amount)

    def _incidents(self, logger: logging.Logger, limit: int | None = None) -> Incidents:
        """Count-and-log-once (:class:`~scd_store.store.log_once.Incidents`) for this tier's own incidents,
        counted through :meth:`_count` (under this tier)."""
        return Incidents(_TierCounts(self), logger, limit)

    def accepts(self, nbytes: int) -> bool:
        """Whether a blob of ``nbytes`` fits this tier (larger ones are counted, never silently dropped)."""
        return self.max_value_bytes is None or nbytes <= self.max_value_bytes

    def set_evict_listener(self, listener: EvictListener | None) -> None:
        """Called as ``listener(tier_name, key, nbytes)`` for every eviction the tier makes by itself."""
        self._on_evict = listener

    def _evicted(self, key: str, nbytes: int) -> None:
        if self._on_evict is not None:
            self._on_evict(self.name, key, nbytes)

    async def start(self) -> None:
        """Open connections / scan state. Called once on the store's loop."""
        return None

    async def close(self) -> None:
        """Release resources."""
        return None

    @abstractmethod
    async def get(self, key: str) -> bytes | None:
        """The value, or None when absent."""

    @abstractmethod
    async def put(self, key: str, value: bytes) -> None:
        """Store ``value`` whole (a reader never sees half of it)."""

    @abstractmethod
    async def contains(self, key: str) -> bool:
        """Whether ``key`` is present."""

    @abstractmethod
    async def delete(self, key: str) -> bool:
        """Remove ``key``; True when it was present."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """Items and bytes held, as far as this process knows."""

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [await self.get(k) for k in keys]

    async def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        for key, value in items:
            await self.put(key, value)

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [await self.contains(k) for k in keys]

    async def delete_many(self, keys: Sequence[str]) -> int:
        return sum([await self.delete(k) for k in keys])

    # shared tiers only: readers may neither delete nor expire there, so they report to the space's producer,
    # which verifies what readers found bad and refreshes the TTL of the hits they reported (ProducerRepair)
    async def touch_many(self, keys: Sequence[str], ttls_ms: Sequence[int] | None = None) -> int:
        """The producer's refresh of the TTL of ``keys`` (a tier with a TTL) to ``ttls_ms`` (default: the tier's
        TTL; never longer); how many it refreshed (keys that are gone are not brought back). Default: none."""
        return 0

    def watch_reports(self, scope: str) -> None:
        """A producer of ``scope`` (``{space_id}:{generation}``) listens for its readers' reports from now on
        (called on the store's loop); default: nothing."""
        return None

    async def report_hits(self, scope: str, keys: Sequence[str]) -> None:
        """Note verified hits of ``scope`` (``{space_id}:{generation}``), so its producer refreshes their TTL;
        default: nothing."""
        return None

    async def report_suspects(self, scope: str, keys: Sequence[str]) -> None:
        """Note keys of ``scope`` (``{space_id}:{generation}``) a reader found bad, for its producer;
        default: nothing."""
        return None

    async def reports(self, kind: str, scope: str, limit: int) -> list[str]:
        """Up to ``limit`` keys readers reported in ``scope`` (``kind``: ``"hits"`` or ``"suspects"``), left
        in place until :meth:`clear_reports`; default: none. Anyone may have written them: verify each."""
        return []

    async def clear_reports(self, kind: str, scope: str, keys: Sequence[str]) -> None:
        """Remove processed reports (as :meth:`reports` returned them); default: nothing."""
        return None


class LocalTier(Tier):
    """A tier in this process's memory: synchronous, thread-safe ``*_now`` methods back the async ones."""

    local = True

    @abstractmethod
    def get_now(self, key: str) -> bytes | None: ...

    @abstractmethod
    def put_now(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def contains_now(self, key: str) -> bool: ...

    @abstractmethod
    def delete_now(self, key: str) -> bool: ...

    def get_many_now(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get_now(k) for k in keys]

    def put_many_now(self, items: Sequence[tuple[str, bytes]]) -> None:
        for key, value in items:
            self.put_now(key, value)

    def contains_many_now(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains_now(k) for k in keys]

    async def get(self, key: str) -> bytes | None:
        return self.get_now(key)

    async def put(self, key: str, value: bytes) -> None:
        self.put_now(key, value)

    async def contains(self, key: str) -> bool:
        return self.contains_now(key)

    async def delete(self, key: str) -> bool:
        return self.delete_now(key)

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self.get_many_now(keys)

    async def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        self.put_many_now(items)

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self.contains_many_now(keys)


class LruTier(LocalTier):
    """A :class:`LocalTier` over a byte-bounded LRU (``self._lru``, set by the subclass): membership,
    deletion and usage are the LRU's."""

    _lru: ByteLRU

    def contains_now(self, key: str) -> bool:
        return key in self._lru

    def contains_many_now(self, keys: Sequence[str]) -> list[bool]:
        return self._lru.contains_many(keys)

    def delete_now(self, key: str) -> bool:
        return self._lru.pop(key) is not None

    def usage(self) -> TierUsage:
        return TierUsage(len(self._lru), self._lru.bytes_used, self._lru.max_bytes)


def _every_space(space_id: str) -> bool:
    return True


class _TierCounts:
    """The store's counters as a tier adds to them: :meth:`Tier._count`, which labels them with the tier (the
    tier label an incident names is the tier's own; its space label is kept)."""

    def __init__(self, tier: Tier) -> None:
        self._tier = tier

    def inc(self, name: str, amount: int = 1, *, tier: str = "", space: str = "", pair: str = "") -> None:
        self._tier._count(name, amount, space=space)
