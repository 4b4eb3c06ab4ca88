"""The bounds of a producer's repair that readers cannot move: how fast it rewrites, which keys it still owes a
rewrite (:class:`RewriteBudget`), and which reported keys it found intact lately (:class:`RecentlyIntact`)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from scd_store.store.births import Births

REWRITE_COOLDOWN_S = 60.0  # a key is rewritten at most once per this long
OWED_S = 600.0  # how long a key the producer deleted stays owed a rewrite (after that its engine stores it again)
MAX_QUARANTINED = 65536  # keys deleted and not yet rewritten that are remembered
INTACT_S = 10.0  # a reported key found intact is not read again for this long (a repair waits at most this)
MAX_INTACT = 65536


class RewriteBudget:
    """Rewrites a producer may make: ``rate`` per second (a token bucket of one second's worth), each key at most
    once per ``cooldown_s``; and the keys it deleted itself, owed a rewrite for :data:`OWED_S`."""

    def __init__(self, rate: float, cooldown_s: float = REWRITE_COOLDOWN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError(f"the rewrite rate must be positive, got {rate}")
        self.rate, self.cooldown_s, self.clock = rate, cooldown_s, clock
        self._tokens, self._at = rate, clock()
        self._last: OrderedDict[str, float] = OrderedDict()
        self.owed: OrderedDict[str, float] = OrderedDict()  # deleted as bad, not rewritten yet: key -> wall time

    def owe(self, keys: Iterable[str]) -> None:
        now = time.time()
        for key in keys:
            self.owed[key] = now
            self.owed.move_to_end(key)
        while len(self.owed) > MAX_QUARANTINED:
            self.owed.popitem(last=False)

    def owes(self, key: str, births: Births) -> bool:
        """Whether ``key`` is still owed a rewrite: deleted by this producer less than :data:`OWED_S` ago, and not
        written by it since (then it lives its own TTL and lifetime, and a report of it being gone is no damage)."""
        at = self.owed.get(key)
        if at is None:
            return False
        if time.time() - at > OWED_S or births.written_after(key, at):
            del self.owed[key]
            return False
        return True

    def take(self, keys: Sequence[str]) -> tuple[list[str], list[str]]:
        """``(allowed, deferred)``: the keys the budget allows now, and those left for a later round."""
        now = self.clock()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        allowed: list[str] = []
        deferred: list[str] = []
        for key in keys:
            last = self._last.get(key)
            if self._tokens < 1 or (last is not None and now - last < self.cooldown_s):
                deferred.append(key)
                continue
            self._tokens -= 1
            allowed.append(key)
        return allowed, deferred

    def done(self, keys: Iterable[str]) -> None:
        """``keys`` were rewritten now."""
        now = self.clock()
        for key in keys:
            self.owed.pop(key, None)
            self._last[key] = now
            self._last.move_to_end(key)
        while self._last and now - next(iter(self._last.values())) > self.cooldown_s:
            self._last.popitem(last=False)


class RecentlyIntact:
    """Reported keys the producer read and found intact in the last :data:`INTACT_S` (the most recent
    :data:`MAX_INTACT`): a report of one of them is a false one, cleared without reading the blob again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._at: OrderedDict[str, float] = OrderedDict()

    def add(self, key: str) -> None:
        self._at[key] = self.clock()
        self._at.move_to_end(key)
        while len(self._at) > MAX_INTACT:
            self._at.popitem(last=False)

    def __contains__(self, key: str) -> bool:
        at = self._at.get(key)
        if at is None:
            return False
        if self.clock() - at > INTACT_S:
            del self._at[key]
            return False
        return True
