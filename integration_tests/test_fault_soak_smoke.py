"""A short run of the fault soak (`scd-store bench soak`), so its harness keeps working: real processes,
real redis-server kills, forged and corrupted blobs, a revocation, and a rogue consumer attacking all run
long; 0 garbage decodes, nothing got through, nothing acknowledged lost uncounted. The measured run (60 s,
3 consumers) is in docs/reliability.md."""

from __future__ import annotations

from scd_store.bench.fault_soak import FaultSoakConfig, run_fault_soak


def test_a_short_fault_soak_serves_no_garbage_and_sees_the_revocation():
    report = run_fault_soak(FaultSoakConfig(processes=1, duration_s=12, prefixes=8, per_wave=2, outage_s=1.0))
    assert report["exit_codes"] == [0, 0, 0] and report["garbage_decodes"] == 0
    assert report["injected"]["redis_kills"] == 2 and sum(report["injected"][k] for k in
                                                         ("corrupted", "forged", "moved")) > 0
    assert report["requests"]["completed"] > 100 and report["requests"]["failed"] == 0
    assert report["detected"]["consumers_refusing_after_revocation"] == 1 and report["ok"]
    assert report["detected"]["bad_signatures"] + report["detected"]["corrupt_blobs"] > 0
    integrity = report["integrity"]
    assert all(a["attempts"] > 0 for a in integrity["rogue_attacks"].values()) and integrity["rogue_got_through"] == 0
    assert integrity["reported_kept"] == integrity["reported_genuine"] > 0  # forged suspect reports deleted nothing
    assert integrity["next_generation_kept"] == integrity["next_generation_blobs"] > 0
    assert integrity["acknowledged_puts"] > 0 and integrity["lost_uncounted"] == 0
    assert report["detected"]["rogue_unsigned_puts"] > 0 and report["detected"]["refused_reports"] > 0
    assert integrity["rogue_attacks"]["flood"]["attempts"] > 0 and integrity["redis_evicted_keys"] == 0  # none got in
    assert integrity["reported_absent"] > 0 and integrity["reported_absent_written"] == 0  # no rewrite on a claim
