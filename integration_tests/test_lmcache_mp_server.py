"""scd-store as an L2 adapter of a real ``lmcache server`` process, driven by LMCache's own
multiprocess client code in a producer process and a consumer process: the consumer retrieves its
own decode of the producer's chunks, at their true positions."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from integration_tests.lmcache_engines import tiny_deployment
from integration_tests.lmcache_mp_client import BLOCK, TOKENS, producer_kv
from integration_tests.lmcache_server import LMCacheServer
from integration_tests.processes import JsonLineProcess
from scd_store.adapters.lmcache.layout import kv_2ltd_views
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.bundle import load_pair, load_space
from scd_store.codecs.scd.codec import ScdCodec
from tests.bundles import LAYOUT, PRODUCER


def client(server: LMCacheServer, model: str, env: dict, transfer: str = "lmcache_driven", salt: str = ""
           ) -> JsonLineProcess:
    return JsonLineProcess("integration_tests.lmcache_mp_client",
                           ["--rpc-url", server.rpc_url, "--http-url", server.http_url, "--model", model,
                            "--transfer-mode", transfer, "--cache-salt", salt], env)


def decoded(bundle, consumer: str, seed: int) -> torch.Tensor:
    """scd-store's decode of the producer's chunks at their true positions, ``[2, L, T, H, D]`` fp16."""
    space = load_space(bundle)
    codec = ScdCodec(space, load_pair(bundle, consumer, space))
    kv = producer_kv(seed)  # [2, L, T, H, D]
    out = torch.zeros(2, LAYOUT.num_layers, TOKENS, LAYOUT.kv_heads * LAYOUT.head_dim, dtype=torch.float16)
    for start in range(0, TOKENS, BLOCK):
        part = kv[:, :, start:start + BLOCK].float().permute(0, 1, 3, 2, 4)
        payload = codec.encode(KVState(part[0].contiguous(), part[1].contiguous(), start=start))
        codec.decode_into(payload, *kv_2ltd_views(out[:, :, start:start + BLOCK], LAYOUT.kv_heads))
    return out.view(2, LAYOUT.num_layers, TOKENS, LAYOUT.kv_heads, LAYOUT.head_dim)


@pytest.fixture
def deployment(tmp_path):
    bundle, store_yaml, env = tiny_deployment(tmp_path)
    params = {"bundles": [str(bundle)], "store_config": str(store_yaml)}
    with LMCacheServer(tmp_path, params, chunk=BLOCK, env=env) as server:
        yield server, bundle, env, tmp_path


def test_two_consumer_engines_retrieve_their_decodes_through_the_server(deployment):
    server, bundle, env, tmp = deployment
    engines = [client(server, PRODUCER, env), client(server, "consumer-a", env), client(server, "consumer-b", env)]
    producer, *consumers = engines
    try:
        # chunked prefill: the first chunk by one store, the rest by the next
        assert producer.ask({"store": {"seq": 3, "seed": 8, "count": BLOCK}}) == {"stored": True}
        assert producer.ask({"store": {"seq": 3, "seed": 8, "start": BLOCK}}) == {"stored": True}
        for name, consumer in zip(("consumer-a", "consumer-b"), consumers, strict=True):
            out = str(tmp / f"{name}.safetensors")
            got = consumer.ask({"retrieve": {"seq": 3, "out": out, "wait_s": 20, "want": TOKENS // BLOCK}})
            assert got == {"hit_chunks": TOKENS // BLOCK, "retrieved": True}
    finally:
        for engine in engines:
            engine.close()
    for name in ("consumer-a", "consumer-b"):
        assert torch.equal(load_file(str(tmp / f"{name}.safetensors"))["kv"], decoded(bundle, name, seed=8))


def test_tenants_salted_apart_never_read_each_others_codes(deployment):
    server, bundle, env, tmp = deployment
    producer = client(server, PRODUCER, env, salt="acme")
    acme, globex = client(server, "consumer-a", env, salt="acme"), client(server, "consumer-a", env, salt="globex")
    try:
        assert producer.ask({"store": {"seq": 6, "seed": 1}}) == {"stored": True}
        out = str(tmp / "t.safetensors")
        assert acme.ask({"retrieve": {"seq": 6, "out": out, "wait_s": 20, "want": TOKENS // BLOCK}})[
            "hit_chunks"] == TOKENS // BLOCK
        assert globex.ask({"retrieve": {"seq": 6, "out": out, "wait_s": 2}})["hit_chunks"] == 0
    finally:
        producer.close(), acme.close(), globex.close()


def test_stores_the_server_gives_no_positions_for_are_not_coded(deployment):
    """The engine-driven transfer publishes no token bindings: nothing is stored, and it is counted."""
    import json

    server, bundle, env, tmp = deployment
    producer = client(server, PRODUCER, env, transfer="engine_driven")
    consumer = client(server, "consumer-a", env)
    try:
        assert producer.ask({"store": {"seq": 5, "seed": 2}}) == {"stored": True}  # L1 has it; scd-store not
        got = consumer.ask({"retrieve": {"seq": 5, "out": str(tmp / "none.safetensors"), "wait_s": 3}})
        assert got["hit_chunks"] == 0
    finally:
        producer.close(), consumer.close()
    server.__exit__()  # the server's store writes its counters on close
    (stats,) = (tmp / "stats").glob("*.json")
    counters = {c["name"]: c["value"] for c in json.loads(stats.read_text())["counters"]}
    assert counters["unpositioned_chunks"] == TOKENS // BLOCK and "puts" not in counters
