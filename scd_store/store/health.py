"""Per-tier health: a failing tier is skipped (a miss) and retried with exponential backoff.

One log line when a tier goes down and one when it comes back, per incident, however many requests
fail in between; a tier that flaps (e.g. a full disk: reads succeed, writes fail) logs at most one
pair of lines per ``quiet_s``, the next one saying how many incidents it left out.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("scd_store.store")


class TierHealth:
    """Tracks one tier's incidents. ``should_try`` lets one probe through each time the backoff expires."""

    def __init__(self, name: str, backoff_min_s: float = 0.1, backoff_max_s: float = 5.0,
                 clock=time.monotonic, quiet_s: float = 30.0) -> None:  # noqa: ANN001
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
        self.quiet_s = quiet_s
        self._logged_at = -float("inf")
        self._unlogged = 0

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
                if now - self._logged_at >= self.quiet_s:
                    more = f" ({self._unlogged} more incidents since the last line)" if self._unlogged else ""
                    log.warning("store tier %s failed (%s: %s); serving misses, retrying with backoff%s",
                                self.name, type(exc).__name__, exc, more)
                    self._logged_at, self._unlogged = now, 0
                else:
                    self._unlogged += 1
            else:
                self._backoff = min(self._backoff * 2, self.backoff_max_s)
            self._next_try = now + self._backoff

    def succeeded(self) -> None:
        if not self.down:
            return
        with self._lock:
            if self.down:
                self.down = False
                if self._unlogged == 0:
                    log.warning("store tier %s recovered after %.1f s", self.name, self._clock() - self._since)
