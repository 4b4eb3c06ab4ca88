"""Chunk positions in LMCache's multiprocess server, from the server's own token bindings: :class:`PositionLedger`.

An L2 adapter sees only object keys and memory objects; a chunk's position is implied by its
prefix-chained hash but not revealed. The server publishes it: on every store it submits (its
server-driven transfer path), an ``MP_TOKENS`` event pairs each chunk hash with the absolute
position of the chunk's first token. :class:`PositionLedger` keeps the most recent of these
pairs, bounded, and answers "where does this chunk start" (waiting a little, since the event may
still be on the bus when a chunk reaches the adapter). A hash it never saw has no position: the
chunk is not stored.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


class PositionLedger:
    """``chunk hash -> first token position``, the ``max_entries`` most recent (LRU)."""

    def __init__(self, max_entries: int = 1 << 20) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self._positions: OrderedDict[bytes, int] = OrderedDict()
        self._changed = threading.Condition()

    def record(self, chunk_hashes: Sequence[bytes], offsets: Sequence[int]) -> None:
        """Remember the positions of a store's chunks."""
        with self._changed:
            for chunk_hash, offset in zip(chunk_hashes, offsets, strict=True):
                self._positions[bytes(chunk_hash)] = int(offset)
                self._positions.move_to_end(bytes(chunk_hash))
            while len(self._positions) > self.max_entries:
                self._positions.popitem(last=False)
            self._changed.notify_all()

    def record_event(self, event: Any) -> None:
        """An event-bus callback for LMCache's ``MP_TOKENS`` events."""
        metadata = event.metadata or {}
        hashes, offsets = metadata.get("chunk_hashes"), metadata.get("token_offsets")
        if hashes and offsets and len(hashes) == len(offsets):
            self.record(hashes, offsets)

    def positions(self, chunk_hashes: Sequence[bytes], timeout: float = 0.0) -> list[int | None]:
        """Each chunk's first token position (None where unknown), waiting up to ``timeout`` for all."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [self._positions.get(bytes(h)) for h in chunk_hashes]
                left = deadline - time.monotonic()
                if None not in found or left <= 0:
                    return found
                self._changed.wait(left)
