"""The store's defaults, defined once: :class:`~scd_store.store.config.StoreConfig` and
:class:`~scd_store.store.tiered.TieredStore` both take them from here."""

from __future__ import annotations

from scd_store.store.keys import DEFAULT_CHUNK_SIZE

CHUNK_SIZE = DEFAULT_CHUNK_SIZE  # tokens per chunk where scd-store hashes tokens itself
OP_TIMEOUT_S = 2.0  # bound on every tier operation
PUT_TIMEOUT_S = 30.0  # how long a put waits on a full write-behind queue
QUEUE_SIZE = 256  # write-behind queue length per lower tier
WRITERS = 2  # write-behind writers per lower tier
BACKOFF_MIN_S = 0.1  # first retry delay of a failed tier
BACKOFF_MAX_S = 5.0  # longest retry delay of a failed tier
REGISTRY_REFRESH_S = 2.0  # how often the registry's version is checked
REPAIR_S = 1.0  # how often a producer takes readers' reports from the shared tiers
REPAIR_RATE = 64.0  # blobs a producer rewrites per second at most on readers' reports
STATS_FLUSH_S = 1.0  # how often counters go to the stats sink
