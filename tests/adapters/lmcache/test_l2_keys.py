"""Object keys of LMCache's multiprocess server as store hashes: the cache_salt is a tenant."""

from __future__ import annotations

from lmcache.v1.distributed.api import ObjectKey

from scd_store.adapters.lmcache.l2_adapter import object_hash


def test_salts_and_chunks_are_other_hashes_and_models_are_not():
    base = ObjectKey(chunk_hash=b"\x01" * 32, model_name="producer", kv_rank=1 << 24)
    consumer = ObjectKey(chunk_hash=b"\x01" * 32, model_name="consumer", kv_rank=1 << 24)  # reads the producer's
    salted = ObjectKey(chunk_hash=b"\x01" * 32, model_name="producer", kv_rank=1 << 24, cache_salt="acme")
    other = ObjectKey(chunk_hash=b"\x02" * 32, model_name="producer", kv_rank=1 << 24)
    assert object_hash(base) == object_hash(consumer) and len(object_hash(base)) == 16
    assert len({object_hash(base), object_hash(salted), object_hash(other)}) == 3
