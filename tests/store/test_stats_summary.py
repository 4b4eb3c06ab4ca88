"""The summary an operator reads first: hit rate per pair and process, misses by reason."""

from __future__ import annotations

from scd_store.store.stats import StoreStats
from scd_store.store.stats_summary import summary


def test_hit_rate_bytes_and_misses_by_reason_per_pair():
    stats = StoreStats()
    stats.inc("requested_tokens", 1024, space="s", pair="s/a")
    stats.record_hit(tier="cpu", space="s", pair="s/a", chunks=3, tokens=768, nbytes=3000, raw_kv_bytes_per_token=20)
    stats.inc("miss_chunks", 1, space="s", pair="s/a")
    stats.inc("refused_chunks", 2, tier="disk", space="s", pair="s/a")
    stats.inc("corrupt_blobs", 1, tier="disk", space="s")
    stats.inc("unpositioned_chunks", 4, space="s")
    stats.inc("refused_requests", pair="stranger")
    stats.inc("tier_errors", tier="redis")
    stats.observe("decode", 0.004, pair="s/a")
    stats.inc("requested_tokens", 256, space="s", pair="s/b")  # a pair that never hit
    report = summary({**stats.snapshot(), "processes": [{"process": {"id": "h-1"}, **stats.snapshot()}]})
    a, b = report["pairs"]
    assert (a["pair"], a["requested_tokens"], a["hit_tokens"], a["hit_rate"]) == ("s/a", 1024, 768, 0.75)
    assert a["bytes_fetched"] == 3000 and a["raw_kv_bytes"] == 768 * 20
    assert a["decode_p50_le_s"] == 0.005
    assert a["misses"] == {"absent": 1, "refused": 2, "deadline": 0, "corrupt": 1, "bad_signature": 0,
                           "other_generation": 0, "revoked": 0, "unpositioned": 4, "hash_mismatch": 0}
    assert b["hit_rate"] == 0.0 and b["decode_p50_le_s"] is None
    assert report["misses"] == {"dropped": 0, "unattributed": 0, "salted": 0, "unsafe_file": 0, "refused_location": 0,
                                "unregistered": 1, "tier_down": 1}
    (proc,) = report["processes"]
    assert proc["requested_tokens"] == 1280 and proc["hit_tokens"] == 768 and proc["tier_errors"] == 1
