"""One log line per kind of incident, for adapters: :class:`LogOnce` (log once) and :class:`Incidents`
(count in the stats, log once), the store's own (:mod:`scd_store.store.log_once`)."""

from scd_store.store.log_once import Incidents, LogOnce

__all__ = ["Incidents", "LogOnce"]
