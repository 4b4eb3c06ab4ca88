"""The store's narrow faces, one per role, all keyed by engine chunk hashes.

:class:`ProducerView` puts into its own space; :class:`ConsumerView` looks up and gets through
its pair and has no write method. Who may hold which view comes from the registry
(:meth:`TieredStore.producer`, :meth:`TieredStore.consumer`); a view holds the store's read path and, for a
producer, its writer, never the store. Tokens become chunk hashes through
:func:`scd_store.store.keys.chunk_hashes` (or the engine's own hashing): one key scheme.
"""

from __future__ import annotations

from collections.abc import Sequence

from scd_store.store.keys import hash_keys
from scd_store.store.read_path import ReadPath
from scd_store.store.records import Pair, Space
from scd_store.store.results import CodeChunk, PrefixHit
from scd_store.store.writer import StoreWriter

__all__ = ["CodeChunk", "ConsumerView", "PrefixHit", "ProducerView"]


class ProducerView:
    """A producer's face: put into its own space, and look up what is already there."""

    def __init__(self, writer: StoreWriter, read: ReadPath, space: Space, producer_model_id: str) -> None:
        self.writer = writer
        self.read = read
        self.space = space
        self.producer_model_id = producer_model_id

    def put(self, hashes: Sequence[bytes], payloads: Sequence[bytes], token_counts: Sequence[int], *,
            codec_id: str) -> list[str]:
        """Store one payload per chunk hash (16 bytes each), covering ``token_counts`` tokens; returns the keys
        stored (the top tier holds them; the lower ones get them through the write-behind)."""
        return self.writer.write(self.space, self.keys(hashes), payloads, token_counts, codec_id)

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        """The store keys of ``hashes`` in this space generation."""
        return hash_keys(self.space.space_id, self.space.generation, hashes)

    def lookup(self, hashes: Sequence[bytes]) -> PrefixHit:
        """The leading run of ``hashes`` present in any tier, with the tier of each chunk."""
        return self.read.lookup(self.space, self.keys(hashes))

    def contains(self, hashes: Sequence[bytes]) -> int:
        """Length of the leading run of ``hashes`` present in any tier."""
        return self.lookup(hashes).hit_chunks

    def readable_by_others(self, hashes: Sequence[bytes]) -> int:
        """Length of the leading run of ``hashes`` that tiers other processes read hold (not counted as a
        lookup): what this space's consumers elsewhere can get."""
        return self.read.readable_by_others(self.space, self.keys(hashes))


class ConsumerView:
    """A registered consumer's face: lookups and verified gets in its pair's space. It cannot write."""

    def __init__(self, read: ReadPath, pair: Pair, space: Space) -> None:
        self.read = read
        self.pair = pair
        self.space = space

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        """The store keys of ``hashes`` in this pair's space generation."""
        return hash_keys(self.space.space_id, self.space.generation, hashes)

    def lookup(self, hashes: Sequence[bytes]) -> PrefixHit:
        """The leading run of ``hashes`` present in any tier, with the tier of each chunk."""
        return self.read.lookup(self.space, self.keys(hashes), self.pair.pair_id)

    def contains(self, hashes: Sequence[bytes]) -> int:
        """Length of the leading run of ``hashes`` present in any tier."""
        return self.lookup(hashes).hit_chunks

    def get(self, hashes: Sequence[bytes]) -> list[CodeChunk]:
        """The verified leading run of chunks stored under ``hashes``."""
        return self.read.get(self.space, self.keys(hashes), self.pair.pair_id)
