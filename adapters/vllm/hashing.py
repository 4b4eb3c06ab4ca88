"""The vLLM connector's hashing canary: :func:`chain_canary`, of scd-store's own chunk chain it keys chunks by."""

from __future__ import annotations

from scd_store.service.hash_agreement import HashCanary, canary_tokens, package_version
from scd_store.service.hashing import chunk_hashes


def chain_canary(chunk_size: int) -> HashCanary:
    """The last hash of scd-store's xxh3-128 chain over the canary tokens (the same in every process)."""
    last = chunk_hashes(canary_tokens(chunk_size), chunk_size)[-1]
    return HashCanary("scd-chain", chunk_size, last.hex(), {"scd-store": package_version("scd-store")})
