"""One :class:`KVService` per process and configuration, shared by the engines that name it."""

from __future__ import annotations

import threading

from scd_store.service.kv_service import KVService
from scd_store.service.settings import EngineSettings
from scd_store.store.build import open_store
from scd_store.store.config import load_config

_lock = threading.Lock()
_services: dict[tuple, tuple[KVService, int]] = {}


def acquire_service(settings: EngineSettings) -> KVService:
    """The process's service for these settings (opened on first use, reference counted)."""
    key = (settings.store_config, settings.bundles, settings.aliases, settings.put_queue_chunks,
           settings.get_deadline_s, settings.models, settings.discovery_interval_s, settings.register_bundles,
           settings.max_positions)
    with _lock:
        entry = _services.get(key)
        if entry is None:
            store = open_store(load_config(settings.store_config))
            try:
                service = KVService(store, settings.bundles, aliases=dict(settings.aliases),
                                    put_queue_chunks=settings.put_queue_chunks,
                                    get_deadline_s=settings.get_deadline_s, models=settings.models,
                                    discovery_interval_s=settings.discovery_interval_s,
                                    register_bundles=settings.register_bundles,
                                    max_positions=settings.max_positions)
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
