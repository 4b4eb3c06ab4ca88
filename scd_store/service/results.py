"""What the service's lookups answer an engine: :class:`Lookup`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lookup:
    """The leading run of chunks a model can get (``chunks``), how many of them only a remote tier
    (Redis, a peer) holds (``remote_chunks``: their get waits on the network), and the tier holding each
    (``tiers``, by name)."""

    chunks: int
    remote_chunks: int = 0
    tiers: tuple[str, ...] = ()
