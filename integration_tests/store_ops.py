"""The engines' key scheme for tests that speak in tokens: tokens become chunk hashes
(:func:`chunk_hashes`), and every read and write goes through the store's producer and consumer views."""

from __future__ import annotations

from collections.abc import Sequence

from scd_store.store.keys import chunk_hashes, generation_of, hash_keys
from scd_store.store.tiered import TieredStore
from scd_store.store.views import CodeChunk, ConsumerView


def keys_of(space_id: str, fingerprint: str, tokens: Sequence[int], chunk_size: int) -> list[str]:
    """The store keys of every whole chunk of ``tokens`` in the generation ``fingerprint`` of ``space_id``."""
    return hash_keys(space_id, generation_of(fingerprint), chunk_hashes(tokens, chunk_size))


def _fingerprint(store: TieredStore, space_id: str) -> str:
    """The fingerprint of the one registered generation of ``space_id`` (these tests register one)."""
    (space,) = [s for s in store.registry.spaces() if s.space_id == space_id]
    return space.fingerprint


def _consumer(store: TieredStore, pair_id: str, consumer: str) -> ConsumerView:
    (pair,) = [p for p in store.registry.pairs() if p.pair_id == pair_id]
    return store.consumer(pair_id, consumer, pair.space_fingerprint)


def put_tokens(store: TieredStore, space_id: str, producer: str, tokens: Sequence[int], payloads: Sequence[bytes],
               codec_id: str = "raw") -> list[str]:
    """The producer's put of one payload per leading whole chunk of ``tokens``; returns the keys."""
    hashes = chunk_hashes(tokens, store.chunk_size)
    if len(payloads) > len(hashes):
        raise ValueError(f"{len(payloads)} payloads for {len(hashes)} whole chunks")
    return store.producer(space_id, producer, _fingerprint(store, space_id)).put(hashes[:len(payloads)], payloads,
                                                  [store.chunk_size] * len(payloads), codec_id=codec_id)


def get_tokens(store: TieredStore, pair_id: str, consumer: str, tokens: Sequence[int]) -> list[CodeChunk]:
    """A registered consumer's verified leading chunks of ``tokens``."""
    return _consumer(store, pair_id, consumer).get(chunk_hashes(tokens, store.chunk_size))


def hit_tokens(store: TieredStore, pair_id: str, consumer: str, tokens: Sequence[int]) -> int:
    """Tokens of the leading run of whole chunks of ``tokens`` a consumer's lookup finds."""
    return _consumer(store, pair_id, consumer).contains(chunk_hashes(tokens, store.chunk_size)) * store.chunk_size
