from scd_store.bench.decode import DecodeBenchConfig, run_decode_bench
from tests.conftest import tiny_llama


def test_decode_bench_reports_side_by_side_timings():
    report = run_decode_bench(DecodeBenchConfig(prefix_tokens=(24, 40), repeats=1), consumer=tiny_llama())
    assert [r["prefix_tokens"] for r in report["results"]] == [24, 40]
    for row in report["results"]:
        assert row["decode_ms"] > 0 and row["prefill_ms"] > 0 and row["encode_ms"] > 0
        assert row["decode_best_ms"] <= row["decode_ms"] and row["prefill_best_ms"] <= row["prefill_ms"]
        assert abs(row["decode_vs_prefill"] - row["decode_best_ms"] / row["prefill_best_ms"]) < 1e-3
        assert abs(row["decode_vs_prefill_median"] - row["decode_ms"] / row["prefill_ms"]) < 1e-3
        assert 0 < row["payload_ratio"] < 1
