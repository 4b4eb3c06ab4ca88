"""LMCacheEngines in separate OS processes sharing one embedded scd-store on a host (CPU + disk +
file registry): a producer engine, a consumer engine, and a base engine serving a LoRA adapter of
the same model. Chunked stores land at their true positions, tenants stay apart, and a consumer
that chunks differently fails loudly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from integration_tests.lmcache_engines import tiny_deployment
from integration_tests.lmcache_process import dense_kv
from integration_tests.processes import JsonLineProcess
from scd_store.adapters.lmcache.layout import kv_2ltd_views
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.bundle import load_pair, load_space
from scd_store.codecs.scd.codec import ScdCodec
from tests.bundles import LAYOUT, PRODUCER

CHUNK, TOKENS = 16, 40


def engine(model: str, bundle, store_yaml, env, chunk: int = CHUNK, **scd) -> JsonLineProcess:
    args = ["--model", model, "--bundle", str(bundle), "--store-yaml", str(store_yaml), "--chunk", str(chunk)]
    for key, value in scd.items():
        args += ["--scd", f"{key}={json.dumps(value)}"]
    return JsonLineProcess("integration_tests.lmcache_process", args, env)


def decoded(bundle, consumer: str, seed: int) -> torch.Tensor:
    """scd-store's decode of the producer's chunks at their true positions, in LMCache's layout (fp16)."""
    space = load_space(bundle)
    codec = ScdCodec(space, load_pair(bundle, consumer, space))
    kv = dense_kv(TOKENS, seed)
    out = torch.zeros_like(kv)
    heads, dim = LAYOUT.kv_heads, LAYOUT.head_dim
    for start in range(0, TOKENS, CHUNK):
        end = min(start + CHUNK, TOKENS)
        part = kv[:, :, start:end].float().view(2, LAYOUT.num_layers, end - start, heads, dim).permute(0, 1, 3, 2, 4)
        payload = codec.encode(KVState(part[0].contiguous(), part[1].contiguous(), start=start))
        codec.decode_into(payload, *kv_2ltd_views(out[:, :, start:end], heads))
    return out


@pytest.fixture
def deployment(tmp_path):
    bundle, store_yaml, env = tiny_deployment(tmp_path)
    processes: list[JsonLineProcess] = []
    yield bundle, store_yaml, env, tmp_path, processes
    for process in processes:
        process.close()


def test_producer_consumer_and_adapter_engines_in_their_own_processes(deployment):
    bundle, store_yaml, env, tmp, processes = deployment
    producer = engine(PRODUCER, bundle, store_yaml, env)
    consumer = engine("consumer-a", bundle, store_yaml, env)
    base_with_adapters = engine(PRODUCER, bundle, store_yaml, env, serves_adapters=True)
    processes += [producer, consumer, base_with_adapters]
    assert all(p.ready["plugin"] for p in processes)
    # chunked prefill: the first chunk was stored by an earlier request, this one stores the rest
    assert producer.ask({"store": {"tokens": CHUNK, "seed": 5}})["drained"]
    assert producer.ask({"store": {"tokens": TOKENS, "seed": 5, "skip_chunks": 1}}) == {"drained": True, "puts": 3}

    got = consumer.ask({"retrieve": {"tokens": TOKENS, "out": str(tmp / "a.safetensors")}})
    assert got == {"hit": TOKENS}
    assert torch.equal(load_file(str(tmp / "a.safetensors"))["kv"], decoded(bundle, "consumer-a", seed=5))

    adapter = {"lmcache.tag.scd_model": "consumer-b"}  # a LoRA adapter served by a base engine
    got = base_with_adapters.ask({"retrieve": {"tokens": TOKENS, "tags": adapter, "out": str(tmp / "b.safetensors")}})
    assert got == {"hit": TOKENS}
    assert torch.equal(load_file(str(tmp / "b.safetensors"))["kv"], decoded(bundle, "consumer-b", seed=5))
    assert base_with_adapters.ask({"store": {"tokens": TOKENS, "seed": 9, "tags": adapter}})["puts"] == 0


def test_a_tenant_tagging_the_producer_in_another_process_reaches_no_one(deployment):
    """The attack across processes: clients of a consumer engine and of an adapter-serving base engine tag
    their requests with the producer's name. Roles come from each engine: neither stores anything, and a
    consumer in a third process reads only what the producer's own engine stored."""
    bundle, store_yaml, env, tmp, processes = deployment
    attacker = engine("consumer-a", bundle, store_yaml, env)
    base_with_adapters = engine(PRODUCER, bundle, store_yaml, env, serves_adapters=True)
    victim = engine("consumer-b", bundle, store_yaml, env)
    processes += [attacker, base_with_adapters, victim]
    as_producer = {"lmcache.tag.scd_model": PRODUCER}
    assert attacker.ask({"store": {"tokens": TOKENS, "seed": 7, "tags": as_producer}}) == {"drained": True, "puts": 0}
    assert attacker.ask({"counters": ["ignored_model_tags"]}) == {"ignored_model_tags": 1}
    for tags in (as_producer, None):  # an engine that serves adapters never writes
        assert base_with_adapters.ask({"store": {"tokens": TOKENS, "seed": 8, "tags": tags}})["puts"] == 0
    assert base_with_adapters.ask({"counters": ["unattributed_chunks"]}) == {"unattributed_chunks": 6}
    out = str(tmp / "v.safetensors")
    for tags in (None, as_producer):
        assert victim.ask({"retrieve": {"tokens": TOKENS, "tags": tags, "out": out}}) == {"hit": 0}
    producer = engine(PRODUCER, bundle, store_yaml, env)
    processes.append(producer)
    assert producer.ask({"store": {"tokens": TOKENS, "seed": 5}}) == {"drained": True, "puts": 3}
    assert victim.ask({"retrieve": {"tokens": TOKENS, "out": out}}) == {"hit": TOKENS}
    assert torch.equal(load_file(out)["kv"], decoded(bundle, "consumer-b", seed=5))


def test_tenants_in_separate_processes_stay_apart(deployment):
    bundle, store_yaml, env, tmp, processes = deployment
    producer = engine(PRODUCER, bundle, store_yaml, env)
    consumer = engine("consumer-a", bundle, store_yaml, env)
    processes += [producer, consumer]
    producer.ask({"store": {"tokens": TOKENS, "seed": 6, "tags": {"lmcache.tag.tenant": "acme"}}})
    out = str(tmp / "t.safetensors")
    assert consumer.ask({"retrieve": {"tokens": TOKENS, "tags": {"lmcache.tag.tenant": "acme"}, "out": out}}) == {
        "hit": TOKENS}
    assert consumer.ask({"retrieve": {"tokens": TOKENS, "tags": {"lmcache.tag.tenant": "globex"}, "out": out}}) == {
        "hit": 0}


def test_a_consumer_process_that_chunks_differently_fails_loudly(deployment):
    bundle, store_yaml, env, _, processes = deployment
    producer = engine(PRODUCER, bundle, store_yaml, env)  # records its hashing canary
    processes.append(producer)
    other = engine("consumer-a", bundle, store_yaml, env, chunk=CHUNK // 2)
    processes.append(other)
    assert other.ready["plugin"] is False
    assert any(f"chunk size: producer {CHUNK}, here {CHUNK // 2}" in line for line in other.ready["errors"])
