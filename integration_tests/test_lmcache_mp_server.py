"""scd-store as an L2 adapter of real ``lmcache server`` processes, driven by LMCache's own multiprocess client
code in producer and consumer processes: the producer engine's own server (role ``producer``, the private key)
and the consumer engines' server (role ``consumer``, the public key). Consumers retrieve their own decode of the
producer's chunks, at their true positions; a client of the consumers' server that names the producer's model
stores nothing; the producer's server serves no consumer, and stores nothing while others can reach it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import yaml
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


def role_config(tmp: Path, store_yaml: Path, role: str) -> Path:
    """The store config of a server of ``role``: the deployment's tiers, its own stats directory."""
    path = tmp / f"{role}-store.yaml"
    settings = {**yaml.safe_load(store_yaml.read_text()), "stats_path": str(tmp / f"stats-{role}")}
    path.write_text(yaml.safe_dump(settings))
    return path


def role_server(tmp: Path, bundle: Path, store_yaml: Path, env: dict, keys: Path, role: str, **kw) -> LMCacheServer:
    """An ``lmcache server`` of ``role`` (a producer's holds the private key file, a consumer's the public one)."""
    params = {"server_role": role, "bundles": [str(bundle)], "store_config": str(role_config(tmp, store_yaml, role))}
    return LMCacheServer(tmp / f"{role}-server", params, chunk=BLOCK, env={**env, "SCD_STORE_SIGNING_KEYS": str(keys)},
                         **kw)


def counters(tmp: Path, role: str) -> dict[str, int]:
    """A server's counters, as its store last wrote them (every second, and on close)."""
    (stats,) = (tmp / f"stats-{role}").glob("*.json")
    return {c["name"]: c["value"] for c in json.loads(stats.read_text())["counters"]}


def settled(tmp: Path, role: str, name: str, want: int, timeout: float = 10.0) -> int:
    """Counter ``name`` of a server once it reaches ``want`` (or ``timeout`` passed: its value then)."""
    deadline = time.monotonic() + timeout
    while (value := counters(tmp, role).get(name, 0)) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, signing_keys):
    """The producer engine's own server (the private key) and the consumer engines' server (the public key), shared
    by the tests below (each uses its own sequences and reads counters as deltas)."""
    tmp = tmp_path_factory.mktemp("lmcache-mp")
    bundle, store_yaml, env = tiny_deployment(tmp)
    with role_server(tmp, bundle, store_yaml, env, signing_keys["private"], "producer") as producer, \
            role_server(tmp, bundle, store_yaml, env, signing_keys["public"], "consumer") as consumer:
        yield {"producer": producer, "consumer": consumer}, bundle, env, tmp


def test_two_consumer_engines_retrieve_their_decodes_through_their_server(deployment):
    servers, bundle, env, tmp = deployment
    engines = [client(servers["producer"], PRODUCER, env), client(servers["consumer"], "consumer-a", env),
               client(servers["consumer"], "consumer-b", env)]
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


def test_a_client_of_the_consumers_server_cannot_write_as_the_producer(deployment):
    """The attack: a consumer engine (or any process reaching the consumers' server) registers under the
    producer's model name and stores KV of its choosing for a prompt. The server stores none of it (it holds no
    private key, and its role refuses producer stores); a genuine consumer misses, then gets the producer's."""
    servers, bundle, env, tmp = deployment
    attacker = client(servers["consumer"], PRODUCER, env)
    consumer = client(servers["consumer"], "consumer-a", env)
    producer = client(servers["producer"], PRODUCER, env)
    refused = settled(tmp, "consumer", "client_role_refusals", 0)
    try:
        assert attacker.ask({"store": {"seq": 7, "seed": 99}}) == {"stored": True}  # L1 took it; scd-store did not
        out = str(tmp / "victim.safetensors")
        assert consumer.ask({"retrieve": {"seq": 7, "out": out, "wait_s": 4}})["hit_chunks"] == 0
        assert producer.ask({"store": {"seq": 7, "seed": 8}}) == {"stored": True}
        got = consumer.ask({"retrieve": {"seq": 7, "out": out, "wait_s": 20, "want": TOKENS // BLOCK}})
        assert got == {"hit_chunks": TOKENS // BLOCK, "retrieved": True}
    finally:
        attacker.close(), consumer.close(), producer.close()
    assert torch.equal(load_file(out)["kv"], decoded(bundle, "consumer-a", seed=8))  # the producer's, not the attacker
    assert settled(tmp, "consumer", "client_role_refusals", refused + TOKENS // BLOCK) == refused + TOKENS // BLOCK


def test_the_producers_server_serves_no_consumer(deployment):
    servers, bundle, env, tmp = deployment
    producer, consumer = client(servers["producer"], PRODUCER, env), client(servers["producer"], "consumer-a", env)
    refused, puts = (settled(tmp, "producer", name, 0) for name in ("client_role_refusals", "puts"))
    try:
        assert producer.ask({"store": {"seq": 4, "seed": 8}}) == {"stored": True}
        got = consumer.ask({"retrieve": {"seq": 4, "out": str(tmp / "none.safetensors"), "wait_s": 3}})
        assert got["hit_chunks"] == 0
    finally:
        producer.close(), consumer.close()
    assert settled(tmp, "producer", "puts", puts + TOKENS // BLOCK) == puts + TOKENS // BLOCK
    assert settled(tmp, "producer", "client_role_refusals", refused + 1) > refused  # the lookups, counted


def test_a_producers_server_others_can_reach_stores_nothing(tmp_path, signing_keys):
    """Bound to every address, anyone reaching it could store as the producer: it stores nothing, counted."""
    bundle, store_yaml, env = tiny_deployment(tmp_path)
    with role_server(tmp_path, bundle, store_yaml, env, signing_keys["private"], "producer", host="0.0.0.0") as server:
        producer = client(server, PRODUCER, env)
        try:
            assert producer.ask({"store": {"seq": 2, "seed": 8}}) == {"stored": True}
            time.sleep(2)  # what the adapter would store is encoded off the server's threads
        finally:
            producer.close()
    stats = counters(tmp_path, "producer")
    assert stats["client_role_refusals"] == TOKENS // BLOCK and "puts" not in stats


def test_tenants_salted_apart_never_read_each_others_codes(deployment):
    servers, bundle, env, tmp = deployment
    producer = client(servers["producer"], PRODUCER, env, salt="acme")
    acme = client(servers["consumer"], "consumer-a", env, salt="acme")
    globex = client(servers["consumer"], "consumer-a", env, salt="globex")
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
    servers, bundle, env, tmp = deployment
    producer = client(servers["producer"], PRODUCER, env, transfer="engine_driven")
    consumer = client(servers["consumer"], "consumer-a", env)
    unpositioned, puts = (settled(tmp, "producer", name, 0) for name in ("unpositioned_chunks", "puts"))
    try:
        assert producer.ask({"store": {"seq": 5, "seed": 2}}) == {"stored": True}  # L1 has it; scd-store not
        got = consumer.ask({"retrieve": {"seq": 5, "out": str(tmp / "none.safetensors"), "wait_s": 3}})
        assert got["hit_chunks"] == 0
    finally:
        producer.close(), consumer.close()
    want = unpositioned + TOKENS // BLOCK
    assert settled(tmp, "producer", "unpositioned_chunks", want) == want
    assert counters(tmp, "producer").get("puts", 0) == puts
