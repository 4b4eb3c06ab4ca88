"""The demo end to end on the real models, with a tiny calibrated bundle for both consumers."""

import re

import pytest

from scd_store.cli.demo.run import DemoConfig, main
from scd_store.models import catalog

pytestmark = pytest.mark.slow


def test_demo_on_real_vllm_servers(tiny_bundle, tmp_path, monkeypatch, capsys):
    pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")
    monkeypatch.setenv("COLUMNS", "240")
    assert main(DemoConfig(bundle=str(tiny_bundle), new_tokens=4, store_dir=str(tmp_path / "demo"),
                           engine="vllm", agreement_requests=2)) == 0
    out = capsys.readouterr().out
    assert "prefilled the shared prefix once" in out and "3 chunks of 256 stored as codes" in out
    for name in catalog.CONSUMERS:
        assert f"{name}: 787-token shared prefix stored once by the base model" in out
        assert f"{name}: request 3 of 3" in out  # progress while it works
        assert re.search(rf"  {name}: next token top-1 codes [0-9.]+% vs raw KV [0-9.]+%, KL [0-9.]+ vs [0-9.]+", out)
    assert out.count("scd codes:") == 6 and out.count("raw KV reuse:") == 6 and out.count("own prefill:") == 6
    # per request: TTFT three ways, next-token top-1 and KL for codes and raw KV, greedy agreement, bytes moved
    rows = re.findall(r"\d+ / \d+ / \d+ ms +│ (\d+)% / (\d+)% +│ (-?[0-9.]+) / (-?[0-9.]+) +│ \d+ / \d+ of \d+ +│",
                      out)
    assert len(rows) == 6 and all(0 <= int(t) <= 100 for row in rows for t in row[:2]), out
    moved = [float(codes) for codes in re.findall(r"([0-9.]+) / 16\.88 MiB", out)]  # codes / the chunks' fp16 KV
    assert len(moved) == 6 and all(0 < codes < 16.88 * 0.3 for codes in moved)
    held_out = out.split("Held-out requests: next token")[1].split("scd-store hits per pair")[0]
    next_token, greedy = held_out.split("Greedy answers on held-out requests")
    for name in catalog.CONSUMERS:  # teacher-forced top-1 of codes and raw KV, their paired difference, KL
        assert re.search(rf"{name} +│ [0-9.]+% \[[0-9.]+, [0-9.]+\] +│ [0-9.]+% \[.* points \[", next_token), next_token
        assert re.search(rf"{name} +│ 2 +│ [0-9.]+% \[[0-9.]+, [0-9.]+\] +│ [0-9.]+% \[", greedy), greedy
    pairs = out.split("scd-store hits per pair")[1].split("per engine process")[0]
    assert pairs.count("100.0%") == 2 and pairs.count("3,328") == 4  # 3 x 768 + 2 held-out x 512 tokens, all hit
    processes = out.split("per engine process")[1]  # each server named by the model it serves and its role
    assert f"producer {catalog.PRODUCER}" in processes
    assert all(f"consumer {name}" in processes for name in catalog.CONSUMERS)


def test_demo_serves_both_consumers_from_codes(tiny_bundle, tmp_path, monkeypatch, capsys):
    bundle = tiny_bundle
    monkeypatch.setenv("COLUMNS", "240")
    assert main(DemoConfig(bundle=str(bundle), new_tokens=4, store_dir=str(tmp_path / "store"),
                           engine="transformers")) == 0
    out = capsys.readouterr().out
    for name in catalog.CONSUMERS:
        assert f"{name}:" in out and "tokens from codes" in out
    assert "prefilled the shared prefix once" in out and "hits per pair" in out
    assert "miss" not in out.split("prefilled")[1].split("scd-store hits per pair")[0]  # every request was served
    assert out.split("scd-store hits per pair")[1].count("100.0%") == 2  # both pairs: every requested token hit
    assert out.count("from codes:") == 6 and out.count("own prefill:") == 6


def test_demo_says_what_is_missing(tmp_path, capsys):
    assert main(DemoConfig(bundle=str(tmp_path / "nowhere"))) == 2
    assert "not a calibration bundle" in capsys.readouterr().err
