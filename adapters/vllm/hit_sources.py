"""Where a consumer's loaded tokens came from, as vLLM (0.33 and later) labels its cache hits by source
(``KVConnectorBase_V1.get_external_cache_hit_sources``): each chunk's tier mapped to vLLM's ``CacheHitSource``.

A GPU tier is the device, the CPU tier host memory, a disk tier disk, a peer tier another process's memory
(``p2p``); Redis is a remote store (``external_unspecified``, vLLM's label for one)."""

from __future__ import annotations

from collections.abc import Sequence

SOURCES = {"gpu": "device", "cpu": "host", "disk": "disk", "peer": "p2p", "redis": "external_unspecified"}
UNKNOWN = "external_unspecified"


def token_sources(tiers: Sequence[str], chunk_size: int, first: int, end: int) -> dict[str, int]:
    """Tokens ``first .. end - 1`` of a hit whose chunk ``i`` a tier named ``tiers[i]`` held, counted by source
    (vLLM's ``CacheHitSource`` values); tokens of chunks whose tier is not known count as ``external_unspecified``."""
    out: dict[str, int] = {}
    for i in range(first // chunk_size, -(-end // chunk_size)):
        tokens = min(end, (i + 1) * chunk_size) - max(first, i * chunk_size)
        if tokens > 0:
            source = SOURCES.get(tiers[i], UNKNOWN) if i < len(tiers) else UNKNOWN
            out[source] = out.get(source, 0) + tokens
    return out
