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


def test_the_server_canary_comes_from_its_own_command_line_and_hasher():
    from scd_store.adapters.lmcache.hashing import mp_server_canary

    base = ["lmcache", "server", "--port", "5555"]
    default = mp_server_canary(base)
    assert default.engine == "lmcache-server" and default.chunk_size == 256  # the server's default
    small = mp_server_canary(base + ["--chunk-size", "16", "--l2-adapter", "{}"])
    assert small.chunk_size == 16 and small.value != default.value
    assert mp_server_canary(base + ["--chunk-size", "16"]) == small  # deterministic (blake3)
    assert mp_server_canary(base + ["--hash-algorithm", "sha256_cbor"]) is None  # would re-seed vLLM: not computed
    assert mp_server_canary(["python", "-m", "pytest"]) is None  # not a server
