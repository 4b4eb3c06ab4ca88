"""Store counters and latency histograms: per tier, per space and per pair.

Every counter is a Prometheus metric ``scd_store_<name>_total`` with labels ``tier``, ``space`` and
``pair`` (empty where not applicable), in the stats object's own ``CollectorRegistry``; latencies go
to ``scd_store_op_seconds`` (labels ``op``, ``tier``, ``pair``). A hit rate is one PromQL division:
``scd_store_hit_tokens_total / scd_store_requested_tokens_total``. A snapshot backs ``scd-store
stats``; :mod:`scd_store.store.stats_sinks` shares it between processes (Redis or per-process files).

Shared counters are written by every process of a deployment, consumers included: whatever is read
back passes :func:`accepted_fields` (known counter names, bounded printable labels, int64 values,
valid histogram buckets), so junk is skipped, never fatal. Counters stay forgeable within that
schema: they are informational, nothing trusts them.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

COUNTERS: dict[str, str] = {
    "lookups": "prefix lookups and gets",
    "requested_tokens": "tokens consumers looked up (whole chunks)",
    "hit_chunks": "chunks served, by the tier that served them",
    "hit_tokens": "tokens covered by served chunks",
    "miss_chunks": "requested chunks not served",
    "bytes_read": "blob bytes read from a tier",
    "bytes_written": "blob bytes written to a tier",
    "bytes_saved": "raw-KV bytes for the hit tokens minus the blob bytes moved",
    "corrupt_blobs": "blobs that failed verification: framing, checksum or bounds (deleted from this host's tiers)",
    "bad_signatures": "blobs without a valid tag where signing keys are configured: unsigned, forged, moved or "
                      "signed with an unknown or expired key (a miss, never decoded)",
    "foreign_blobs": "well-formed blobs of another space generation or codec under a key: a miss, never deleted",
    "quarantined_blobs": "bad blobs deleted: by a producer (the keys readers reported in shared tiers) or by a "
                         "reader from this host's tiers",
    "repaired_blobs": "bad blobs in a shared tier a producer rewrote from a good copy in its own tiers",
    "unsigned_puts": "producer chunks not stored because the keyring held no valid private key for their space",
    "keyring_errors": "key file reloads that failed: a file that no longer parses (its old keys stay) or is gone "
                      "(its keys no longer sign or verify)",
    "oversized_writes": "blobs larger than a tier's max_value_bytes: never written there (nothing is owed)",
    "unsafe_files": "disk tier entries that are no regular file (symlinks, FIFOs, devices) or larger than its "
                    "bound: a miss, removed",
    "ttl_refreshes": "blob TTLs a producer refreshed from the hits its readers reported",
    "refused_refreshes": "reported hits whose TTL a producer did not refresh: blobs it did not write itself (or no "
                         "longer remembers), or at the end of their max_lifetime_s",
    "refused_reports": "reported keys (hits or bad blobs) outside the reporter's space generation, malformed, or "
                       "reported bad where nothing is stored (no damage): ignored",
    "dropped_reports": "reported keys a producer's inbox had no room for (it keeps 8,192 per kind and space "
                       "generation): dropped",
    "false_reports": "keys readers reported bad that their producer found intact (or had found intact in the "
                     "last 10 s: not read again)",
    "deferred_repairs": "bad blobs a producer deleted whose rewrite waits for a later round (its repair_rate is "
                        "spent, or the key was rewritten less than a minute ago)",
    "evicted_blobs": "blobs of a producer's space generations that Redis evicted (keyspace events, with "
                     "notify-keyspace-events Ee on the server)",
    "subscription_errors": "a producer's subscriptions to its readers' reports or its blobs' evictions that Redis "
                           "refused (its user's ACL) or lost (a dropped connection): not heard until made again",
    "refused_locations": "peer directory entries a reader refused: unsigned, forged, moved, bound to another "
                         "source info, malformed or out of bounds (a miss, never read)",
    "refilled_chunks": "chunks a producer's engine served from its own prefix cache that the store had lost: "
                       "stored again",
    "refill_timeouts": "finished producer requests (vLLM) whose blocks were held for a refill check not answered "
                       "within the hold (10 s): released without a refill",
    "ignored_model_tags": "requests whose model tag named another model than the engine's own: the tag is ignored "
                          "(roles come from the engine)",
    "salted_chunks": "chunks of requests with a cache_salt on a path that cannot keep salts apart: neither "
                     "stored nor served",
    "revoked_requests": "requests of models whose space or pair the registry no longer holds (revoked): a miss",
    "registry_refreshes": "times the registry's version changed and its cached answers were re-read",
    "rejected_blobs": "promotions a lower tier's queue had no room for (nothing is owed)",
    "dropped_writes": "blobs a lower tier did not get when written (down, queue full, write failed): kept for its "
                      "re-sync",
    "resynced_writes": "dropped blobs written to their tier after it came back (read back from the top tier)",
    "lost_writes": "dropped blobs no re-sync will write (forgotten past resync_keys, gone from the top tier, or "
                   "pending at close)",
    "tier_errors": "tier operations that failed or timed out",
    "store_errors": "engine calls into the store that failed as a whole (a walk past its deadline, the store's loop "
                    "gone): a miss, never an exception in the engine",
    "evictions": "blobs a tier evicted to stay in its bounds",
    "promotions": "blobs copied up to a faster tier on a hit",
    "puts": "chunks written by producers",
    "refused_requests": "engine requests for models that are no registered producer or consumer",
    "dropped_puts": "producer chunks dropped because the put queue was full (or closing)",
    "uncodable_chunks": "producer chunks the code space cannot code (shape, NaN or inf): not stored",
    "failed_puts": "producer chunks whose put failed on the put worker (a bug or a store failure; logged): not stored",
    "unpositioned_chunks": "producer chunks whose absolute position the engine did not give: not stored",
    "unattributed_chunks": "chunks of requests an adapter-serving engine did not attribute to a model: not served",
    "unkeyable_requests": "engine requests whose token ids do not say what their KV holds (prompt embeddings, "
                          "multimodal inputs): neither stored nor served",
    "deadline_chunks": "chunks a get left undecoded because its deadline had passed",
    "lookup_deadlines": "consumer requests whose lookup was not in by lookup_deadline_s: computed by the engine",
    "lookup_errors": "consumer lookups that raised (a tier or registry error): computed by the engine",
    "load_deadlines": "asynchronous loads (vLLM) not done by load_deadline_s: the blocks they had not filled are "
                      "recomputed by the engine",
    "discovered_models": "models bound after start from pairs and spaces registered later (scd-store register)",
    "discovery_errors": "registered pairs a process could not load (a moved bundle, fingerprints that differ)",
    "refused_chunks": "stored chunks the consumer's codec refused (another packing or space): a miss",
    "hash_mismatch": "engine processes whose chunk hashing differs from their space's producer (canary)",
    "client_role_refusals": "keys an LMCache server's client sent for a role the server does not serve (a store "
                            "naming the producer on a consumer's server, a consumer's lookup on a producer's, a store "
                            "on a producer's server others can reach): refused",
}
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   float("inf"))
REDIS_STATS_KEY = "scd:__stats__"
INT64_MAX = (1 << 63) - 1
MAX_LABEL_CHARS = 256
_LABEL_RE = re.compile(r"[\x20-\x7b\x7d\x7e]*")  # printable ASCII but "|", the fields' separator
_VALUE_RE = re.compile(r"[0-9]{1,19}")
Label = tuple[str, str, str]  # tier, space, pair
HistKey = tuple[str, str, str]  # op, tier, pair


class StoreStats:
    """Thread-safe counters + histograms, exported to Prometheus and snapshotted for the CLI."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._counters = {name: Counter(f"scd_store_{name}", doc, ("tier", "space", "pair"), registry=self.registry)
                          for name, doc in COUNTERS.items()}
        self._latency = Histogram("scd_store_op_seconds", "store operation latency", ("op", "tier", "pair"),
                                  buckets=LATENCY_BUCKETS, registry=self.registry)
        self._lock = threading.Lock()
        self._values: dict[tuple[str, str, str, str], int] = defaultdict(int)
        self._buckets: dict[HistKey, list[int]] = {}
        self._pending: dict[str, int] = defaultdict(int)
        self._server: Any = None
        self._serves: Callable[[], Mapping[str, str]] | None = None

    def describe_process(self, serves: Callable[[], Mapping[str, str]]) -> None:
        """Name what this process serves in its stats records: ``serves()`` gives each bound model's role,
        asked at every flush (``scd-store stats`` shows it beside the process)."""
        self._serves = serves

    def serves(self) -> dict[str, str]:
        """Each model this process serves and its role (``{}`` when nothing was described)."""
        if self._serves is None:
            return {}
        try:
            return {str(model): str(role) for model, role in self._serves().items()}
        except Exception:  # a description must never break a flush
            return {}

    def inc(self, name: str, amount: int = 1, *, tier: str = "", space: str = "", pair: str = "") -> None:
        if amount == 0:
            return
        if name not in COUNTERS:
            raise ValueError(f"unknown store counter {name!r}")
        self._counters[name].labels(tier, space, pair).inc(amount)
        with self._lock:
            self._values[(name, tier, space, pair)] += amount
            self._pending[f"c|{name}|{tier}|{space}|{pair}"] += amount

    def observe(self, op: str, seconds: float, *, tier: str = "", pair: str = "") -> None:
        self._latency.labels(op, tier, pair).observe(seconds)
        index = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        with self._lock:
            counts = self._buckets.setdefault((op, tier, pair), [0] * len(LATENCY_BUCKETS))
            counts[index] += 1
            self._pending[f"h|{op}|{tier}|{pair}|{index}"] += 1

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
            for (op, tier, pair), counts in self._buckets.items():
                for i, c in enumerate(counts):
                    if c:
                        fields[f"h|{op}|{tier}|{pair}|{i}"] = c
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
    """Turn ``c|name|tier|space|pair`` / ``h|op|tier|pair|bucket`` fields (local, from Redis, or several
    processes' added up) into a snapshot; ``buckets`` keeps the raw histogram counts for merging."""
    counters: list[dict[str, Any]] = []
    hist: dict[HistKey, list[int]] = {}
    for field, value in fields.items():
        parts = field.split("|")
        if parts[0] == "c" and len(parts) == 5:
            counters.append({"name": parts[1], "tier": parts[2], "space": parts[3], "pair": parts[4],
                             "value": int(value)})
        elif parts[0] == "h" and len(parts) == 5 and parts[4].isdigit() and int(parts[4]) < len(LATENCY_BUCKETS):
            hist.setdefault((parts[1], parts[2], parts[3]), [0] * len(LATENCY_BUCKETS))[int(parts[4])] += int(value)
    counters.sort(key=lambda c: (c["name"], c["tier"], c["space"], c["pair"]))
    latency = [{"op": op, "tier": tier, "pair": pair, "count": sum(counts), "p50_le_s": _quantile(counts, 0.5),
                "p99_le_s": _quantile(counts, 0.99), "buckets": counts}
               for (op, tier, pair), counts in sorted(hist.items())]
    return {"counters": counters, "latency": latency}


def snapshot_fields(snapshot: Any) -> dict[str, int]:
    """The inverse of :func:`snapshot_from_fields` (so snapshots can be added up); entries that are not
    of the schema (a damaged snapshot file) are skipped."""
    fields: dict[str, Any] = {}
    if not isinstance(snapshot, dict):
        return {}
    counters, latency = snapshot.get("counters"), snapshot.get("latency")
    for c in counters if isinstance(counters, list) else []:
        if isinstance(c, dict) and all(isinstance(c.get(k), str) for k in ("name", "tier", "space", "pair")):
            fields[f"c|{c['name']}|{c['tier']}|{c['space']}|{c['pair']}"] = c.get("value")
    for h in latency if isinstance(latency, list) else []:
        if not isinstance(h, dict) or not all(isinstance(h.get(k, ""), str) for k in ("op", "tier", "pair")):
            continue
        buckets = h.get("buckets")
        for i, count in enumerate(buckets[:len(LATENCY_BUCKETS)] if isinstance(buckets, list) else []):
            if count:
                fields[f"h|{h.get('op')}|{h.get('tier')}|{h.get('pair', '')}|{i}"] = count
    return accepted_fields(fields)


def valid_label(label: object) -> bool:
    """A label (tier, space, pair, op) the shared counters accept: at most 256 printable ASCII chars but ``|``."""
    return isinstance(label, str) and len(label) <= MAX_LABEL_CHARS and _LABEL_RE.fullmatch(label) is not None


def _value(raw: object) -> int | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw if 0 <= raw <= INT64_MAX else None
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    if isinstance(raw, str) and _VALUE_RE.fullmatch(raw) and int(raw) <= INT64_MAX:
        return int(raw)
    return None


def _schema_field(field: str) -> bool:
    parts = field.split("|")
    if len(parts) != 5 or not all(valid_label(p) for p in parts[1:]):
        return False
    if parts[0] == "c":
        return parts[1] in COUNTERS
    return parts[0] == "h" and parts[4].isdigit() and len(parts[4]) <= 2 and int(parts[4]) < len(LATENCY_BUCKETS)


def accepted_fields(raw: Mapping[Any, Any]) -> dict[str, int]:
    """The fields of ``raw`` (a shared hash as read: bytes or str names, bytes / str / int values) that are of
    the schema: ``c|<counter in COUNTERS>|tier|space|pair`` or ``h|op|tier|pair|<bucket index>``, labels
    :func:`valid_label`, values ints in ``0..2**63-1``. Everything else is skipped."""
    fields: dict[str, int] = {}
    for name, raw_value in raw.items():
        if isinstance(name, bytes):
            try:
                name = name.decode("ascii")
            except UnicodeDecodeError:
                continue
        if not isinstance(name, str) or len(name) > 5 * (MAX_LABEL_CHARS + 1) or not _schema_field(name):
            continue
        value = _value(raw_value)
        if value is not None:
            fields[name] = value
    return fields


def merge_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters and histograms of several processes added up."""
    total: dict[str, int] = defaultdict(int)
    for snapshot in snapshots:
        for field, value in snapshot_fields(snapshot).items():
            total[field] += value
    return snapshot_from_fields(dict(total))
