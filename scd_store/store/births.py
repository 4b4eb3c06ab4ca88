"""What a producer knows of the blobs it wrote itself: when it wrote each, and when it last refreshed its TTL
(:class:`Births`). Readers' reports are claims; these are the producer's own records, so a TTL it refreshes
on a reader's word never outlives the blob's maximum lifetime, counted from when the producer wrote it."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

MAX_BIRTHS = 100_000  # blobs remembered (the most recently written): about 25 MB; older ones live their TTL out


class Births:
    """``key -> (written at, TTL last refreshed at)`` (wall-clock seconds) of the ``max_entries`` most recently
    written blobs of this process; thread-safe (the writer records, the repair round reads)."""

    def __init__(self, max_entries: int = MAX_BIRTHS, clock: Callable[[], float] = time.time) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def wrote(self, keys: Iterable[str]) -> None:
        """``keys`` were written now (a blob written again is born again)."""
        now = self.clock()
        with self._lock:
            for key in keys:
                self._entries[key] = (now, now)
                self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def ttl_for(self, key: str, ttl_ms: int, lifetime_ms: int | None, every_ms: int) -> int | None:
        """The TTL (ms) to refresh ``key``'s to now; 0 when it was refreshed less than ``every_ms`` ago (nothing to
        do); None when it may not be: not written by this process (or forgotten), or at the end of its lifetime.
        A TTL returned is recorded as refreshed."""
        now = self.clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            born, refreshed = entry
            left = ttl_ms if lifetime_ms is None else int((born * 1000 + lifetime_ms) - now * 1000)
            if left <= 0:
                return None
            if (now - refreshed) * 1000 < every_ms:
                return 0
            self._entries[key] = (born, now)
            return min(ttl_ms, left)

    def written_after(self, key: str, at: float) -> bool:
        """Whether this process wrote ``key`` after wall-clock time ``at`` (as far as it remembers)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry[0] > at

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries
