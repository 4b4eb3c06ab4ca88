"""The engine-neutral face of scd-store, between the engine adapters and the store and codecs.

Bindings of engine model names to code spaces and pairs, calibration bundles loaded into a
running store, :class:`KVService` (encode a producer's chunks, decode a consumer's straight into
engine buffers, and what adapters need of the store: its chunk size and key chain, its counters),
the process's shared service (:func:`acquire_service`) and the settings every engine adapter reads.
Engine adapters import nothing from :mod:`scd_store.store` (an import-linter contract).
"""

from scd_store.service.bindings import Binding, Role, ServiceError, pair_id_for
from scd_store.service.kv_service import Buffers, KVService, PagedTargets
from scd_store.service.put_path import UncodableChunks
from scd_store.service.results import Lookup
from scd_store.service.settings import EngineSettings, SettingsError
from scd_store.service.shared import acquire_service, release_service

__all__ = [
    "Binding",
    "Buffers",
    "EngineSettings",
    "KVService",
    "Lookup",
    "PagedTargets",
    "Role",
    "ServiceError",
    "SettingsError",
    "UncodableChunks",
    "acquire_service",
    "release_service",
    "pair_id_for",
]
