"""One log line per kind of incident (the store's :class:`~scd_store.store.log_once.LogOnce`, for adapters)."""

from scd_store.store.log_once import LogOnce

__all__ = ["LogOnce"]
