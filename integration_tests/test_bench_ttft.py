"""The TTFT bench end to end on the real models (tiny prefixes; speed claims live in the bench JSON)."""

import pytest

from scd_store.bench.ttft import TtftConfig, plot_ttft, run_ttft

pytestmark = pytest.mark.slow


def test_ttft_report_has_every_part_per_method_and_link(tmp_path):
    config = TtftConfig(prefix_tokens=(64,), suffix_tokens=4, repeats=1, methods=("raw", "int4", "droidspeak"))
    report = run_ttft(config, progress=False)
    (entry,) = report["prefixes"]
    assert entry["own_prefill_ms"] > 0 and report["transfer_overhead_ms"] > 0
    raw, int4 = entry["methods"]["raw"], entry["methods"]["int4"]
    assert int4["payload_bytes"] < 0.35 * raw["payload_bytes"]
    for method in entry["methods"].values():
        links = method["links"]
        assert set(links) == {"1", "10", "100"}
        # a faster link never makes the first token later; the fetch term scales with 1 / bandwidth
        assert links["1"]["ttft_ms"] >= links["10"]["ttft_ms"] >= links["100"]["ttft_ms"]
        assert abs(links["1"]["fetch_ms"] / links["10"]["fetch_ms"] - 10) < 0.01
    plot_ttft(report, tmp_path / "ttft.png")
    assert (tmp_path / "ttft.png").stat().st_size > 1000


def test_scd_needs_a_bundle():
    with pytest.raises(ValueError, match="bundle"):
        TtftConfig(methods=("scd",))
