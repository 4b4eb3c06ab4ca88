"""Store counters and latency histograms: per tier, per space and per pair.

Every counter is a Prometheus metric ``scd_store_<name>_total`` with labels ``tier``, ``space`` and
``pair`` (empty where not applicable), in the stats object's own ``CollectorRegistry``; latencies go
to ``scd_store_op_seconds`` (labels ``op``, ``tier``). A local snapshot backs ``scd-store stats``, and
:class:`RedisStatsMirror` adds the deltas to one Redis hash (``HINCRBY``) so a deployment's processes
share totals.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections import defaultdict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

COUNTERS: dict[str, str] = {
    "lookups": "prefix lookups and gets",
    "hit_chunks": "chunks served, by the tier that served them",
    "hit_tokens": "tokens covered by served chunks",
    "miss_chunks": "requested chunks not served",
    "bytes_read": "blob bytes read from a tier",
    "bytes_written": "blob bytes written to a tier",
    "bytes_saved": "raw-KV bytes for the hit tokens minus the blob bytes moved",
    "corrupt_blobs": "blobs that failed verification (evicted)",
    "rejected_blobs": "blobs a tier refused (too large, queue full)",
    "tier_errors": "tier operations that failed or timed out",
    "evictions": "blobs a tier evicted to stay in its bounds",
    "promotions": "blobs copied up to a faster tier on a hit",
    "puts": "chunks written by producers",
    "refused_requests": "engine requests for models that are no registered producer or consumer",
    "dropped_puts": "producer chunks dropped because the put queue was full (or closing)",
    "uncodable_chunks": "producer chunks the code space cannot code (shape, NaN or inf): not stored",
    "unpositioned_chunks": "producer chunks whose absolute position the engine did not give: not stored",
    "deadline_chunks": "chunks a get left undecoded because its deadline had passed",
}
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   float("inf"))
REDIS_STATS_KEY = "scd:__stats__"
Label = tuple[str, str, str]  # tier, space, pair


class StoreStats:
    """Thread-safe counters + histograms, exported to Prometheus and snapshotted for the CLI."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._counters = {name: Counter(f"scd_store_{name}", doc, ("tier", "space", "pair"), registry=self.registry)
                          for name, doc in COUNTERS.items()}
        self._latency = Histogram("scd_store_op_seconds", "store operation latency", ("op", "tier"),
                                  buckets=LATENCY_BUCKETS, registry=self.registry)
        self._lock = threading.Lock()
        self._values: dict[tuple[str, str, str, str], int] = defaultdict(int)
        self._buckets: dict[tuple[str, str], list[int]] = {}
        self._pending: dict[str, int] = defaultdict(int)
        self._server: Any = None

    def inc(self, name: str, amount: int = 1, *, tier: str = "", space: str = "", pair: str = "") -> None:
        if amount == 0:
            return
        if name not in COUNTERS:
            raise ValueError(f"unknown store counter {name!r}")
        self._counters[name].labels(tier, space, pair).inc(amount)
        with self._lock:
            self._values[(name, tier, space, pair)] += amount
            self._pending[f"c|{name}|{tier}|{space}|{pair}"] += amount

    def observe(self, op: str, seconds: float, *, tier: str = "") -> None:
        self._latency.labels(op, tier).observe(seconds)
        index = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        with self._lock:
            counts = self._buckets.setdefault((op, tier), [0] * len(LATENCY_BUCKETS))
            counts[index] += 1
            self._pending[f"h|{op}|{tier}|{index}"] += 1

    def record_hit(self, *, tier: str, space: str, pair: str, chunks: int, tokens: int, nbytes: int,
                   raw_kv_bytes_per_token: int) -> None:
        """A tier served ``chunks`` chunks (``tokens`` tokens, ``nbytes`` blob bytes)."""
        self.inc("hit_chunks", chunks, tier=tier, space=space, pair=pair)
        self.inc("hit_tokens", tokens, tier=tier, space=space, pair=pair)
        self.inc("bytes_read", nbytes, tier=tier, space=space, pair=pair)
        if raw_kv_bytes_per_token > 0:
            saved = max(0, tokens * raw_kv_bytes_per_token - nbytes)  # tiny chunks can cost more than raw: no saving
            self.inc("bytes_saved", saved, tier=tier, space=space, pair=pair)

    def value(self, name: str, *, tier: str | None = None, space: str | None = None, pair: str | None = None) -> int:
        """Sum of a counter over the labels not given."""
        with self._lock:
            return sum(v for (n, t, s, p), v in self._values.items()
                       if n == name and tier in (None, t) and space in (None, s) and pair in (None, p))

    def take_pending(self) -> dict[str, int]:
        """The deltas since the last call (for the Redis mirror)."""
        with self._lock:
            pending, self._pending = dict(self._pending), defaultdict(int)
        return pending

    def restore_pending(self, pending: dict[str, int]) -> None:
        """Put back deltas that could not be flushed."""
        with self._lock:
            for field, amount in pending.items():
                self._pending[field] += amount

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready view of the counters and latency histograms of this process."""
        with self._lock:
            fields = {f"c|{n}|{t}|{s}|{p}": v for (n, t, s, p), v in self._values.items()}
            for (op, tier), counts in self._buckets.items():
                for i, c in enumerate(counts):
                    if c:
                        fields[f"h|{op}|{tier}|{i}"] = c
        return snapshot_from_fields(fields)

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Start a Prometheus endpoint for this registry; returns the bound port."""
        from prometheus_client import start_http_server

        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return server.server_address[1]

    def stop_http(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _quantile(counts: list[int], q: float) -> float | None:
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= rank:
            return LATENCY_BUCKETS[i]
    return LATENCY_BUCKETS[-1]


def snapshot_from_fields(fields: dict[str, int]) -> dict[str, Any]:
    """Turn ``c|name|tier|space|pair`` / ``h|op|tier|bucket`` fields (local or from Redis) into a snapshot."""
    counters: list[dict[str, Any]] = []
    hist: dict[tuple[str, str], list[int]] = {}
    for field, value in fields.items():
        parts = field.split("|")
        if parts[0] == "c" and len(parts) == 5:
            counters.append({"name": parts[1], "tier": parts[2], "space": parts[3], "pair": parts[4],
                             "value": int(value)})
        elif parts[0] == "h" and len(parts) == 4 and parts[3].isdigit() and int(parts[3]) < len(LATENCY_BUCKETS):
            hist.setdefault((parts[1], parts[2]), [0] * len(LATENCY_BUCKETS))[int(parts[3])] += int(value)
    counters.sort(key=lambda c: (c["name"], c["tier"], c["space"], c["pair"]))
    latency = [{"op": op, "tier": tier, "count": sum(counts), "p50_le_s": _quantile(counts, 0.5),
                "p99_le_s": _quantile(counts, 0.99)} for (op, tier), counts in sorted(hist.items())]
    return {"counters": counters, "latency": latency}


class RedisStatsMirror:
    """Adds a :class:`StoreStats`' deltas to the deployment-wide Redis hash ``scd:__stats__``."""

    def __init__(self, url: str, client: Any = None) -> None:
        from scd_store.store.redis_url import make_sync_client

        self.client = client if client is not None else make_sync_client(url)

    def flush(self, stats: StoreStats) -> int:
        """HINCRBY every pending delta; on failure the deltas are kept for the next flush. Returns fields sent."""
        pending = stats.take_pending()
        if not pending:
            return 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for field, amount in pending.items():
                pipe.hincrby(REDIS_STATS_KEY, field, amount)
            pipe.execute()
        except Exception:
            stats.restore_pending(pending)
            raise
        return len(pending)

    def read(self) -> dict[str, Any]:
        raw = self.client.hgetall(REDIS_STATS_KEY)
        return snapshot_from_fields({(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()})

    def close(self) -> None:
        self.client.close()


def read_redis_stats(url: str) -> dict[str, Any]:
    """The deployment-wide snapshot kept in Redis at ``url``."""
    mirror = RedisStatsMirror(url)
    try:
        return mirror.read()
    finally:
        mirror.close()


def write_snapshot_file(stats: StoreStats, path: str) -> None:
    """Write a process's snapshot as JSON (what ``scd-store stats`` reads without Redis)."""
    import os
    import tempfile

    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(stats.snapshot(), f, indent=1)
    os.replace(tmp, path)
