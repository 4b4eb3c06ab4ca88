"""The store as the service's operations reach it: :class:`StoreAccess`.

A binding's producer or consumer view comes from the store, which caches the registry's answer; a
space or pair revoked in the registry is a miss (``revoked_requests``, logged once per model); a lookup
that fails otherwise (the registry unreachable, an unreadable record) is a miss counted as
``store_errors``. A call
into the store from an engine's thread that fails as a whole (a tier walk past its deadline, the
store's loop gone) is a miss too (``store_errors``), never an exception in the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from scd_store.service.bindings import Binding
from scd_store.store.log_once import Incidents
from scd_store.store.records import NotRegistered
from scd_store.store.tiered import TieredStore
from scd_store.store.views import ConsumerView, ProducerView

T = TypeVar("T")


class StoreAccess:
    """Views of ``store`` by binding (None once revoked) and engine-safe store calls, counted in ``incidents``."""

    def __init__(self, store: TieredStore, incidents: Incidents) -> None:
        self.store = store
        self.incidents = incidents

    def producer(self, binding: Binding) -> ProducerView | None:
        """The store's write face for a producer; None once its space is revoked."""
        try:
            return self.store.producer(binding.space.space_id, binding.model, binding.space.fingerprint)
        except NotRegistered as exc:
            return self._revoked(binding, exc)
        except Exception as exc:  # noqa: BLE001 - a registry lookup that fails is a miss, not an engine error
            return self._failed("producer lookup", exc)

    def consumer(self, binding: Binding) -> ConsumerView | None:
        """The store's read face for a consumer; None once its pair is revoked (a miss)."""
        try:
            return self.store.consumer(binding.pair_id, binding.model, binding.space.fingerprint)
        except NotRegistered as exc:
            return self._revoked(binding, exc)
        except Exception as exc:  # noqa: BLE001 - a registry lookup that fails is a miss, not an engine error
            return self._failed("consumer lookup", exc)

    def call(self, what: str, call: Callable[[], T], default: T) -> T:
        """``call()``, or ``default`` when it fails (counted as ``store_errors``, logged once per ``what``)."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - an engine's step must not fail on the store
            self._failed(what, exc)
            return default

    def _failed(self, what: str, exc: Exception) -> None:
        self.incidents.count("store_errors", "scd-store: a store %s failed (a miss; counted as store_errors; "
                             "logged once): %s: %s", what, type(exc).__name__, exc, once=f"store:{what}")

    def _revoked(self, binding: Binding, exc: Exception) -> None:
        self.incidents.count("revoked_requests", "scd-store: %r is not (or no longer) registered: its requests miss "
                             "(counted as revoked_requests; logged once): %s", binding.model, exc,
                             once=f"revoked:{binding.model}", space=binding.space.space_id, pair=binding.pair_id)
