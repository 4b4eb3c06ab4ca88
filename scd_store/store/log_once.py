"""One log line per kind of incident, however often it recurs (engines call scd-store per request).

:class:`LogOnce` logs; :class:`Incidents` counts an incident in the stats and logs its first occurrence,
the pattern every miss-not-error path follows ("a wrong answer is worse than a miss": count it, say it once).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol


class LogOnce:
    """``warn(what, message, *args)`` logs ``message`` the first time ``what`` happens.

    ``limit`` bounds the kinds remembered (where ``what`` carries names others choose): past it, a new
    kind is not logged."""

    def __init__(self, logger: logging.Logger, limit: int | None = None) -> None:
        self.logger = logger
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def warn(self, what: str, message: str, *args: Any) -> None:
        """Log ``message % args`` unless ``what`` was logged before (or the bound is reached)."""
        with self._lock:
            if what in self._seen or (self.limit is not None and len(self._seen) >= self.limit):
                return
            self._seen.add(what)
        self.logger.warning(message, *args)


class Counts(Protocol):
    """Where incidents are counted: :class:`~scd_store.store.stats.StoreStats` or a tier's view of it."""

    def inc(self, name: str, amount: int = 1, *, tier: str = "", space: str = "", pair: str = "") -> None: ...


class Incidents:
    """Count an incident and log its first occurrence: ``count(counter, message, *args, n=, once=, labels)``.

    ``once`` (default: the counter's name) is what "first" means: one line per counter, or per counter and
    model, tier... The message should name the counter so a reader finds it in ``scd-store stats``.
    ``limit``: as :class:`LogOnce`'s."""

    def __init__(self, stats: Counts, logger: logging.Logger, limit: int | None = None) -> None:
        self.stats = stats
        self.log = LogOnce(logger, limit)

    def count(self, counter: str, message: str, *args: Any, n: int = 1, once: str | None = None,
              tier: str = "", space: str = "", pair: str = "") -> None:
        """``stats.inc(counter, n, tier=, space=, pair=)``, then ``message % args`` the first time ``once``."""
        self.stats.inc(counter, n, tier=tier, space=space, pair=pair)
        self.log.warn(once or counter, message, *args)
