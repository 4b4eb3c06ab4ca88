"""bench engine-put runs a real LMCacheEngine and every chunk it offered reaches the store."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="LMCache takes its sha256_cbor chunk hash from vLLM (make vllm)")

from scd_store.bench.engine_put import EnginePutConfig, run_engine_put_bench


@pytest.mark.slow
def test_every_offered_chunk_is_stored_and_latencies_are_reported():
    report = run_engine_put_bench(EnginePutConfig(prompts=2, prompt_tokens=64, chunk_tokens=32, layers=2))
    for path in ("put_queue", "encode_on_engine_thread"):
        assert report[path]["chunks_offered"] == 4 and report[path]["chunks_stored"] == 4
        assert 0 < report[path]["plugin_put"]["p50_ms"] <= report[path]["engine_store"]["max_ms"]
    assert report["store_p50_ratio"] > 0
