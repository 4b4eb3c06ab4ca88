"""Per-tier health: a failing tier is skipped (a miss) and retried with exponential backoff.

One log line when a tier goes down and one when it comes back, per incident, however many requests
fail in between.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("scd_store.store")


class TierHealth:
    """Tracks one tier's incidents. ``should_try`` lets one probe through each time the backoff expires."""

    def __init__(self, name: str, backoff_min_s: float = 0.1, backoff_max_s: float = 5.0,
                 clock=time.monotonic) -> None:  # noqa: ANN001
        self.name = name
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._lock = threading.Lock()
        self.down = False
        self.incidents = 0
        self._since = 0.0
        self._backoff = backoff_min_s
        self._next_try = 0.0

    def should_try(self) -> bool:
        if not self.down:
            return True
        with self._lock:
            now = self._clock()
            if now < self._next_try:
                return False
            self._next_try = now + self._backoff  # only one probe per backoff period
            return True

    def due(self) -> bool:
        """Whether a call now would be let through (no probe is used up asking)."""
        return not self.down or self._clock() >= self._next_try

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            now = self._clock()
            if not self.down:
                self.down = True
                self.incidents += 1
                self._since = now
                self._backoff = self.backoff_min_s
                log.warning("store tier %s failed (%s: %s); serving misses, retrying with backoff",
                            self.name, type(exc).__name__, exc)
            else:
                self._backoff = min(self._backoff * 2, self.backoff_max_s)
            self._next_try = now + self._backoff

    def succeeded(self) -> None:
        if not self.down:
            return
        with self._lock:
            if self.down:
                self.down = False
                log.warning("store tier %s recovered after %.1f s", self.name, self._clock() - self._since)
