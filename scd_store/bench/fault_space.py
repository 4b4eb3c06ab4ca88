"""The fault soak's one code space, shared by its processes (:mod:`scd_store.bench.fault_worker`, the rogue in
:mod:`scd_store.bench.fault_rogue`, the harness in :mod:`scd_store.bench.fault_soak`): its names, keys and the
one payload each key ever holds."""

from __future__ import annotations

import hashlib

SPACE, PAIR, PRODUCER, CONSUMER, FINGERPRINT = "soak", "soak/consumer", "soak-producer", "soak-consumer", "soak-fp"
OTHER_FINGERPRINT = "soak-fp-next"  # a second generation of the space (a rollout), whose blobs must never be deleted
CHUNK = 4


def prefix_hashes(index: int, chunks: int) -> list[bytes]:
    from scd_store.store.keys import chunk_hashes

    return chunk_hashes([index * 1000 + t for t in range(chunks * CHUNK)], CHUNK)


def store_keys(index: int, chunks: int, fingerprint: str = FINGERPRINT) -> list[str]:
    from scd_store.store.keys import generation_of, hash_keys

    return hash_keys(SPACE, generation_of(fingerprint), prefix_hashes(index, chunks))


def other_generation_keys() -> list[str]:
    """Keys of the next generation's blobs the harness writes at the start (never to be deleted by the soak)."""
    return [k for i in range(2) for k in store_keys(10_000 + i, 4, OTHER_FINGERPRINT)]


def payload_for(key: str, size: int) -> bytes:
    """The one payload a chunk key ever holds: any other bytes served are a garbage decode."""
    digest = hashlib.sha256(key.encode()).digest()
    return (digest * (size // len(digest) + 1))[:size]
