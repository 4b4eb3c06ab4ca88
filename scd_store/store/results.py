"""What a read of the store returns: :class:`CodeChunk` (one verified chunk of a get) and :class:`PrefixHit`
(a lookup's answer)."""

from __future__ import annotations

from dataclasses import dataclass

from scd_store.store.blob import BlobMeta


@dataclass(frozen=True, slots=True)
class CodeChunk:
    """One verified chunk out of the store: its key, position, tokens covered, codec payload and header."""

    key: str
    index: int
    token_count: int
    payload: memoryview
    meta: BlobMeta
    tier: str


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A lookup's answer: the leading run of chunks present, which tier holds each of them, and how many of
    them only a remote tier (Redis, a peer) holds (a get of those waits on the network)."""

    hit_chunks: int
    total_chunks: int
    tiers: tuple[str, ...]
    remote_chunks: int = 0
