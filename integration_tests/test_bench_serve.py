"""``scd-store bench serve`` against real vLLM servers, small: every route and concurrency has its row,
and the answers from codes are scd-store's own decode path's (engine fidelity)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

pytestmark = pytest.mark.slow


def test_bench_serve_measures_every_route_and_the_answers_from_codes(tiny_bundle, tmp_path):
    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, "-m", "scd_store.cli.main", "bench", "serve", "--bundle", str(tiny_bundle),
                    "--prefix-tokens", "512", "--concurrency", "1", "2", "--waves", "1", "--new-tokens", "4",
                    "--agreement-windows", "1", "--root", str(tmp_path / "deployment"), "--json", str(out)],
                   check=True, timeout=900)
    report = json.loads(out.read_text())
    assert report["kind"] == "measured"
    cells = {(r["concurrency"], r["route"]): r for r in report["rows"]}
    assert set(cells) == {(c, route) for c in (1, 2) for route in ("own", "scd", "raw")}
    assert all(r["stored_tokens"] == 512 and r["ttft_p50_ms"] > 0 and r["requests"] == r["concurrency"]
               for r in report["rows"])
    assert {(s["concurrency"], s["route"]) for s in report["speedups"]} == {
        (c, route) for c in (1, 2) for route in ("scd", "raw")}
    assert [a["consumer"] for a in report["agreement"]] == ["smollm2-135m-shakespeare", "smollm2-135m-python"]
    for entry in report["agreement"]:
        fidelity = entry["engine_fidelity"]
        assert fidelity["tokens_equal_before_first_difference"] == "4 of 4"
        assert fidelity["logprob_abs_diff_max"] < 2e-3
        assert entry["against_own_answer"]["scd"]["answers"] == 1
