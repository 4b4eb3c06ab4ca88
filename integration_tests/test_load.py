"""32 concurrent clients (16 threads here + 2 processes x 8 threads), 10k mixed operations, CPU + Redis."""

from integration_tests.redis_servers import RedisServer
from scd_store.bench.soak import SoakConfig, run_soak


def test_concurrent_clients_no_torn_reads_no_lost_writes(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        report = run_soak(SoakConfig(server.url, threads=16, processes=2, threads_per_process=8, ops=10_000))
    assert report["clients"] == 32 and report["ops"] >= 9_984
    assert report["torn_reads"] == 0
    assert report["acknowledged_chunks"] > 0 and report["lost_writes"] == 0
    counters = report["store_counters"]
    assert counters["evictions"] > 0  # the CPU tier was under pressure
    assert counters["corrupt_blobs"] == 0 and counters["rejected_blobs"] == 0 and counters["tier_errors"] == 0
    # worker processes start fresh, so their peak is the store's own footprint under this load
    # (this process's peak also holds whatever earlier tests loaded, e.g. the real models)
    assert max(report["peak_rss_mib"][1:]) < 1024
    assert report["per_op"]["get"]["p99_ms"] > 0
