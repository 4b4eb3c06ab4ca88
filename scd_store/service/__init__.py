"""The engine-neutral face of scd-store, between the engine adapters and the store and codecs.

Bindings of engine model names to code spaces and pairs, calibration bundles loaded into a
running store, :class:`KVService` (encode a producer's chunks, decode a consumer's straight into
engine buffers) and the settings every engine adapter reads.
"""

from scd_store.service.bindings import Binding, ServiceError, pair_id_for
from scd_store.service.kv_service import Buffers, KVService
from scd_store.service.settings import EngineSettings, SettingsError
from scd_store.service.shared import acquire_service, release_service

__all__ = [
    "Binding",
    "Buffers",
    "EngineSettings",
    "KVService",
    "ServiceError",
    "SettingsError",
    "acquire_service",
    "release_service",
    "pair_id_for",
]
