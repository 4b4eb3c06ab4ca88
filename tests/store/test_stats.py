from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import generate_latest

from scd_store.store.stats import StoreStats, snapshot_from_fields


def test_counters_and_labels() -> None:
    stats = StoreStats()
    stats.record_hit(tier="cpu", space="s", pair="p", chunks=2, tokens=512, nbytes=1000, raw_kv_bytes_per_token=100)
    stats.inc("tier_errors", tier="redis")
    stats.inc("evictions", 3, tier="disk", space="s")
    assert stats.value("hit_tokens") == 512 and stats.value("hit_chunks", tier="cpu", pair="p") == 2
    assert stats.value("bytes_saved", space="s") == 512 * 100 - 1000
    assert stats.value("evictions", tier="cpu") == 0 and stats.value("evictions") == 3
    text = generate_latest(stats.registry).decode()
    assert 'scd_store_hit_tokens_total{pair="p",space="s",tier="cpu"} 512.0' in text
    assert 'scd_store_tier_errors_total{pair="",space="",tier="redis"} 1.0' in text
    with pytest.raises(ValueError, match="unknown store counter"):
        stats.inc("nope")


def test_latency_histogram_snapshot() -> None:
    stats = StoreStats()
    for _ in range(98):
        stats.observe("get", 0.0002, tier="cpu")
    stats.observe("get", 0.02, tier="cpu")
    stats.observe("get", 0.02, tier="cpu")
    (entry,) = stats.snapshot()["latency"]
    assert entry["count"] == 100 and entry["p50_le_s"] == 0.00025 and entry["p99_le_s"] == 0.025
    assert "scd_store_op_seconds_bucket" in generate_latest(stats.registry).decode()


def test_pending_deltas_round_trip_through_fields() -> None:
    stats = StoreStats()
    stats.inc("lookups", 2, space="s", pair="p")
    stats.observe("lookup", 0.0001)
    pending = stats.take_pending()
    assert stats.take_pending() == {}
    snap = snapshot_from_fields(pending)
    assert snap["counters"] == [{"name": "lookups", "tier": "", "space": "s", "pair": "p", "value": 2}]
    assert snap["latency"][0]["count"] == 1
    stats.restore_pending(pending)
    assert stats.take_pending() == pending


def test_http_endpoint() -> None:
    stats = StoreStats()
    stats.inc("puts", 7, space="s")
    port = stats.serve_http(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        stats.stop_http()
    assert 'scd_store_puts_total{pair="",space="s",tier=""} 7.0' in body


def test_only_fields_of_the_schema_are_accepted() -> None:
    """What any process (a consumer too) may have written to the shared hashes: junk is skipped, never fatal."""
    from scd_store.store.stats import INT64_MAX, accepted_fields

    raw = {b"c|lookups|cpu|s|p": b"5", "c|puts|||": INT64_MAX, b"h|get|cpu||16": b"2",  # all of the schema
           b"c|nope|||": b"1", b"c|lookups|||": b"1.5", b"c|lookups|a||": b"-1", b"c|lookups|b||": b"9" * 20,
           b"c|lookups|c||": str(INT64_MAX + 1).encode(), b"c|lookups|d||": b"", b"c|lookups|e||": b" 1",
           b"c|lookups|f||": True, b"c|lookups|g||": 1.0, b"c|lookups|" + b"t" * 257 + b"||": b"1",
           b"c|lookups|\x1b||": b"1", "c|lookups|\u00e9||": b"1", b"\xff|lookups|||": b"1", b"c|lookups||": b"1",
           b"h|get|||17": b"1", b"h|get|||-1": b"1", b"h|get|||x": b"1", b"x|get|||1": b"1", b"garbage": b"1"}
    assert accepted_fields(raw) == {"c|lookups|cpu|s|p": 5, "c|puts|||": INT64_MAX, "h|get|cpu||16": 2}
    snap = snapshot_from_fields(accepted_fields(raw))
    assert [c["value"] for c in snap["counters"]] == [5, INT64_MAX] and snap["latency"][0]["count"] == 2
