"""The LMCache route under real vLLM-CPU servers: LMCache's own vLLM connector with scd-store's CPU
GPU connector (``scd_store.adapters.vllm.lmcache_cpu``) and the scd-store LMCache plugin, a producer
server and a consumer server over one Redis."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from integration_tests.redis_servers import RedisServer  # noqa: E402
from integration_tests.vllm_harness import hit_tokens, reference, settled_hits, wait_until  # noqa: E402
from scd_store.bench.vllm_server import ServerSpec, VllmServer, choice_tokens  # noqa: E402
from scd_store.codecs.kv_state import KVState  # noqa: E402
from scd_store.models import catalog  # noqa: E402
from scd_store.models.prepare import model_dir  # noqa: E402
from scd_store.models.windows import eval_windows  # noqa: E402
from scd_store.service import KVService  # noqa: E402
from scd_store.store.build import open_store  # noqa: E402
from scd_store.store.config import load_config  # noqa: E402

pytestmark = pytest.mark.slow
CHUNK, CHUNKS, TAIL, NEW = 256, 2, 40, 8
LMCACHE_KV = {"kv_connector": "LMCacheCpuConnector", "kv_connector_module_path": "scd_store.adapters.vllm.lmcache_cpu",
              "kv_role": "kv_both"}


def lmcache_yaml(path, bundle, store_yaml, aliases: dict[str, str]):
    path.write_text(yaml.safe_dump({
        "chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.2, "storage_plugins": ["scd"],
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
