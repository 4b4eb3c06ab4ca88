"""What the service's lookups answer an engine: :class:`Lookup`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lookup:
    """The leading run of chunks a model can get (``chunks``), and how many of them only a remote tier
    (Redis, a peer) holds (``remote_chunks``: their get waits on the network)."""

    chunks: int
    remote_chunks: int = 0
