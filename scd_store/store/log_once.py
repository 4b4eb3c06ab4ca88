"""One log line per kind of incident, however often it recurs (engines call scd-store per request)."""

from __future__ import annotations

import logging
import threading
from typing import Any


class LogOnce:
    """``warn(what, message, *args)`` logs ``message`` the first time ``what`` happens."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def warn(self, what: str, message: str, *args: Any) -> None:
        with self._lock:
            if what in self._seen:
                return
            self._seen.add(what)
        self.logger.warning(message, *args)
