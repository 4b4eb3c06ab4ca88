import pytest
import torch

from scd_store.bench.decode import DecodeBenchConfig, run_decode_bench
from tests.conftest import tiny_llama


def test_decode_bench_reports_side_by_side_timings():
    report = run_decode_bench(DecodeBenchConfig(prefix_tokens=(24, 40), repeats=1), consumer=tiny_llama())
    assert [r["prefix_tokens"] for r in report["results"]] == [24, 40]
    for row in report["results"]:
        assert row["decode_ms"] > 0 and row["prefill_ms"] > 0 and row["encode_ms"] > 0
        assert row["decode_best_ms"] <= row["decode_ms"] and row["prefill_best_ms"] <= row["prefill_ms"]
        # ratios are rounded from the exact times, the ms from which they are recomputed here to 3 decimals
        ratio = row["decode_best_ms"] / row["prefill_best_ms"]
        assert abs(row["decode_vs_prefill"] - ratio) < 1e-3 * max(1.0, ratio)
        median_ratio = row["decode_ms"] / row["prefill_ms"]
        assert abs(row["decode_vs_prefill_median"] - median_ratio) < 1e-3 * max(1.0, median_ratio)
        assert 0 < row["payload_ratio"] < 1
        assert row["decode_into_best_ms"] > 0
        assert abs(row["decode_into_vs_prefill"] - row["decode_into_best_ms"] / row["prefill_best_ms"]) < 1e-3
        assert ("decode_fp32_products_best_ms" in row) == (report["products"] == "bfloat16")


def test_an_entropy_coded_space_is_timed_in_both_payload_formats():
    report = run_decode_bench(DecodeBenchConfig(prefix_tokens=(40,), repeats=1, budget=0.12, quantiser="ecsq"),
                              consumer=tiny_llama())
    row = report["results"][0]
    assert row["packing"] == "ans-1" and row["decode_planes-2_best_ms"] > 0
    assert row["payload_ratio"] < row["payload_planes-2_ratio"]  # range coding spends fewer bytes on the same codes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bench_decodes_from_device_memory_with_graphs():
    report = run_decode_bench(DecodeBenchConfig(prefix_tokens=(24,), repeats=2, device="cuda"),
                              consumer=tiny_llama().to("cuda"))
    row = report["results"][0]
    assert report["payload_on"] == "device" and row["graph_replays"] > 0
    assert min(row["decode_from_host_best_ms"], row["decode_eager_best_ms"], row["decode_fused_best_ms"]) > 0


def test_the_random_init_geometries_are_the_published_configs_and_others_are_refused():
    from scd_store.bench.geometries import GEOMETRIES, geometry

    assert set(GEOMETRIES) == {"smollm2-135m", "llama3-8b"}
    llama = geometry("llama3-8b")
    assert (llama["num_hidden_layers"], llama["num_key_value_heads"], llama["head_dim"]) == (32, 8, 128)
    assert geometry("smollm2-135m")["num_key_value_heads"] == 3
    with pytest.raises(ValueError, match="geometry"):
        DecodeBenchConfig(geometry="gpt-5")
    with pytest.raises(ValueError, match="geometry"):
        geometry("gpt-5")
