"""One :class:`KVService` per process and configuration, shared by the engines that name it.

The engine's :class:`~scd_store.service.settings.EngineSettings` are handed down from here: its
``store_config`` to :func:`~scd_store.store.config.load_config` and
:func:`~scd_store.store.build.open_store`, its service keywords to :class:`KVService`.
"""

from __future__ import annotations

import threading

from scd_store.service.kv_service import KVService
from scd_store.service.settings import EngineSettings
from scd_store.store.build import open_store
from scd_store.store.config import load_config

_lock = threading.Lock()
_services: dict[EngineSettings, tuple[KVService, int]] = {}


def acquire_service(settings: EngineSettings) -> KVService:
    """The process's service for these settings (opened on first use, reference counted)."""
    key = settings.shared_key()
    with _lock:
        entry = _services.get(key)
        if entry is None:
            store = open_store(load_config(settings.store_config))
            try:
                service = KVService(store, settings.bundles, **settings.service_kwargs())
            except BaseException:
                store.close()
                raise
            entry = (service, 0)
        _services[key] = (entry[0], entry[1] + 1)
        return entry[0]


def release_service(service: KVService) -> None:
    """Drop one reference; the last one closes the store (draining its write queues)."""
    with _lock:
        for key, (held, refs) in list(_services.items()):
            if held is service:
                if refs <= 1:
                    del _services[key]
                    service.close()
                else:
                    _services[key] = (held, refs - 1)
                return
