"""Tokens to chunk hashes for callers above the service: :func:`chunk_hashes`, the store's one key chain.

Engines that bring no chunk hashing of their own (the vLLM connector, benches, the demo) key chunks by
this chain; it is the store's (:func:`scd_store.store.keys.chunk_hashes`), offered here so engine
adapters need nothing from :mod:`scd_store.store`. :meth:`KVService.chunk_hashes
<scd_store.service.kv_service.KVService.chunk_hashes>` hashes at the service's chunk size.
"""

from __future__ import annotations

from scd_store.store.keys import chunk_hashes

__all__ = ["chunk_hashes"]
