"""What an operator reads first: per pair and per process, requested against hit tokens, bytes
fetched against their raw-KV equivalent, decode latency and misses by reason, from a stats view
(:mod:`scd_store.store.stats_sinks`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

# miss reasons and the counter behind each ("space": counted per space, "tier": per tier)
MISS_REASONS = {
    "absent": ("miss_chunks", "pair"),
    "refused": ("refused_chunks", "pair"),
    "deadline": ("deadline_chunks", "pair"),
    "corrupt": ("corrupt_blobs", "space"),
    "bad_signature": ("bad_signatures", "space"),
    "other_generation": ("foreign_blobs", "space"),
    "revoked": ("revoked_requests", "pair"),
    "unpositioned": ("unpositioned_chunks", "space"),
    "hash_mismatch": ("hash_mismatch", "space"),
    "dropped": ("dropped_puts", "all"),
    "unattributed": ("unattributed_chunks", "all"),
    "salted": ("salted_chunks", "all"),
    "unsafe_file": ("unsafe_files", "all"),
    "refused_location": ("refused_locations", "all"),
    "unregistered": ("refused_requests", "all"),
    "tier_down": ("tier_errors", "all"),
}


def _sum(counters: list[dict[str, Any]], name: str, **labels: str) -> int:
    return sum(c["value"] for c in counters if c["name"] == name and all(c[k] == v for k, v in labels.items()))


def _latency(latency: list[dict[str, Any]], op: str, pair: str) -> tuple[float | None, float | None]:
    entries = [h for h in latency if h["op"] == op and h.get("pair", "") == pair]
    if not entries:
        return None, None
    best = max(entries, key=lambda h: h["count"])
    return best["p50_le_s"], best["p99_le_s"]


def hit_rate(hit: int, requested: int) -> float | None:
    return hit / requested if requested else None


def pair_rows(view: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per consumer pair seen in the counters."""
    counters = view["counters"]
    pairs: dict[str, str] = {}
    for c in counters:
        if c["pair"] and c["space"] and c["name"] in ("requested_tokens", "hit_tokens", "lookups"):
            pairs[c["pair"]] = c["space"]
    rows = []
    for pair, space in sorted(pairs.items()):
        requested = _sum(counters, "requested_tokens", pair=pair)
        hit = _sum(counters, "hit_tokens", pair=pair)
        fetched = _sum(counters, "bytes_read", pair=pair)
        raw = fetched + _sum(counters, "bytes_saved", pair=pair)
        p50, p99 = _latency(view["latency"], "decode", pair)
        misses = {reason: _sum(counters, name, **({"pair": pair} if scope == "pair" else {"space": space}))
                  for reason, (name, scope) in MISS_REASONS.items() if scope in ("pair", "space")}
        rows.append({"space": space, "pair": pair, "requested_tokens": requested, "hit_tokens": hit,
                     "hit_rate": hit_rate(hit, requested), "bytes_fetched": fetched, "raw_kv_bytes": raw,
                     "decode_p50_le_s": p50, "decode_p99_le_s": p99, "misses": misses})
    return rows


def deployment_misses(view: dict[str, Any]) -> dict[str, int]:
    """Misses and losses that belong to no pair: unregistered models, dropped puts, failing tiers."""
    counters = view["counters"]
    return {reason: _sum(counters, name) for reason, (name, scope) in MISS_REASONS.items() if scope == "all"}


def process_rows(view: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per process of the view."""
    rows = []
    for entry in view.get("processes", []):
        counters = entry["counters"]
        requested, hit = _sum(counters, "requested_tokens"), _sum(counters, "hit_tokens")
        totals: dict[str, int] = defaultdict(int)
        for c in counters:
            totals[c["name"]] += c["value"]
        rows.append({"process": entry.get("process", {}), "requested_tokens": requested, "hit_tokens": hit,
                     "hit_rate": hit_rate(hit, requested), "puts": totals["puts"],
                     "dropped_puts": totals["dropped_puts"], "unpositioned_chunks": totals["unpositioned_chunks"],
                     "hash_mismatch": totals["hash_mismatch"], "tier_errors": totals["tier_errors"]})
    return rows


def summary(view: dict[str, Any]) -> dict[str, Any]:
    """The JSON-ready summary ``scd-store stats`` opens with."""
    return {"pairs": pair_rows(view), "processes": process_rows(view), "misses": deployment_misses(view)}
