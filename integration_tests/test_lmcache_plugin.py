"""The scd-store LMCache plugin inside real LMCacheEngines (CPU): producer stores, consumer retrieves."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from integration_tests.lmcache_engines import make_engine, plugin_config, scd_backend, write_store_yaml
from scd_store.adapters.lmcache.identity import SALT_TAG, TAG
from scd_store.adapters.lmcache.layout import kv_2ltd_views
from scd_store.adapters.lmcache.plugin import ScdStoragePlugin
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.bundle import load_pair, load_space
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.service import SettingsError
from tests.bundles import LAYOUT, PRODUCER, correlated_state, write_tiny_bundle

from lmcache.v1.cache_engine import LMCacheEngineBuilder  # isort: skip

CHUNK, TOKENS = 16, 40  # two whole chunks and a partial one
MODEL_TAG, SALT_TAG_CONFIG = TAG + "scd_model", TAG + SALT_TAG
HEADS, DIM = LAYOUT.kv_heads, LAYOUT.head_dim


@pytest.fixture
def setup(tmp_path):
    """The bundle, the store settings, and ``start(model, config, kv)``: an engine destroyed after the test."""
    bundle = tmp_path / "bundle"
    write_tiny_bundle(bundle, consumers=("consumer-a", "consumer-b"))
    store_yaml = write_store_yaml(tmp_path / "store.yaml", tmp_path / "disk")
    instances: list[str] = []

    def start(model: str, config, kv: torch.Tensor, record_positions: bool = True):
        instance, engine = make_engine(model, config, kv, HEADS, record_positions=record_positions)
        instances.append(instance)
        return engine

    yield bundle, store_yaml, start
    for instance in instances:
        LMCacheEngineBuilder.destroy(instance)


def producer_kv() -> torch.Tensor:
    state = correlated_state(TOKENS, seed=11)
    kv = torch.stack([state.keys, state.values]).permute(0, 1, 3, 2, 4)  # [2, L, T, H, D]
    return kv.reshape(2, LAYOUT.num_layers, TOKENS, HEADS * DIM).half().contiguous()


def expected_consumer_kv(bundle, consumer: str, kv: torch.Tensor) -> torch.Tensor:
    """scd-store's own decode of the producer's chunks for ``consumer``, straight into chunk buffers in
    LMCache's layout and dtype (as the plugin decodes; close to the fp32 decode, tests/codecs)."""
    space = load_space(bundle)
    codec = ScdCodec(space, load_pair(bundle, consumer, space))
    out = torch.zeros_like(kv)
    for start in range(0, TOKENS, CHUNK):
        end = min(start + CHUNK, TOKENS)
        chunk = kv[:, :, start:end].float().view(2, LAYOUT.num_layers, end - start, HEADS, DIM).permute(0, 1, 3, 2, 4)
        payload = codec.encode(KVState(chunk[0].contiguous(), chunk[1].contiguous(), start=start))
        buffer = torch.empty(2, LAYOUT.num_layers, end - start, HEADS * DIM, dtype=kv.dtype)
        codec.decode_into(payload, *kv_2ltd_views(buffer, HEADS))
        fp32 = codec.decode(payload)
        assert torch.allclose(buffer[0].float(), fp32.keys.permute(0, 2, 1, 3).reshape(buffer[0].shape), atol=2e-2)
        out[:, :, start:end] = buffer
    return out


def test_consumer_engine_retrieves_its_own_decode_of_the_producer_prefix(setup):
    bundle, store_yaml, start = setup
    config = plugin_config([bundle], store_yaml, CHUNK)
    kv = producer_kv()
    tokens = torch.arange(100, 100 + TOKENS)
    producer = start(PRODUCER, config, kv)
    assert isinstance(scd_backend(producer), ScdStoragePlugin)
    producer.store(tokens)
    assert scd_backend(producer).drain(timeout=30)
    for consumer in ("consumer-a", "consumer-b"):
        out = torch.zeros_like(kv)
        engine = start(consumer, config, out)
        assert engine.lookup(tokens) == TOKENS
        retrieved = engine.retrieve(tokens)
        assert int(retrieved.sum()) == TOKENS
        assert torch.equal(out, expected_consumer_kv(bundle, consumer, kv))
    service = scd_backend(producer).service
    assert service.store.stats.value("hit_chunks") == 2 * 3


def test_unknown_model_misses_with_a_log_line(setup, caplog):
    bundle, store_yaml, start = setup
    config = plugin_config([bundle], store_yaml, CHUNK)
    kv = producer_kv()
    tokens = torch.arange(TOKENS)
    producer = start(PRODUCER, config, kv)
    producer.store(tokens)
    with caplog.at_level(logging.WARNING, logger="scd_store.adapters.lmcache"):
        stranger = start("stranger", config, torch.zeros_like(kv))
    assert "is in no bundle" in caplog.text
    assert stranger.lookup(tokens) == 0


def refused_store(setup, caplog, kv: torch.Tensor, tokens: torch.Tensor, warning: str,
                  record_positions: bool = True) -> None:
    """The producer stores ``tokens``; the plugin logs ``warning``, stores nothing, the consumer misses."""
    bundle, store_yaml, start = setup
    config = plugin_config([bundle], store_yaml, CHUNK)
    producer = start(PRODUCER, config, kv, record_positions=record_positions)
    with caplog.at_level(logging.WARNING):
        producer.store(tokens)
        assert scd_backend(producer).drain(timeout=30)
    assert warning in caplog.text
    consumer = start("consumer-a", config, torch.zeros_like(kv))
    assert consumer.lookup(tokens) == 0  # the whole batch was refused: nothing half-stored


def test_without_chunk_positions_nothing_is_stored(setup, caplog):
    refused_store(setup, caplog, producer_kv(), torch.arange(7, 7 + TOKENS), "records no chunk positions",
                  record_positions=False)
    assert "unpositioned_chunks" in caplog.text


def test_a_store_that_skips_a_cached_prefix_is_coded_at_its_true_positions(setup):
    """Chunked prefill / a partial prefix hit: LMCache stores only the chunks after the first one
    (a mask whose leading tokens are False). Their positions start at 16, not 0."""
    bundle, store_yaml, start = setup
    config = plugin_config([bundle], store_yaml, CHUNK)
    kv = producer_kv()
    tokens = torch.arange(3, 3 + TOKENS)
    producer = start(PRODUCER, config, kv)
    mask = torch.ones(TOKENS, dtype=torch.bool)
    mask[:CHUNK] = False
    producer.store(tokens[:CHUNK])  # the first chunk, stored by an earlier request
    producer.store(tokens, mask=mask)
    assert scd_backend(producer).drain(timeout=30)
    out = torch.zeros_like(kv)
    consumer = start("consumer-a", config, out)
    assert consumer.lookup(tokens) == TOKENS
    consumer.retrieve(tokens)
    assert torch.equal(out, expected_consumer_kv(bundle, "consumer-a", kv))


def test_puts_return_at_once_and_the_put_queue_bounds_what_waits(setup):
    bundle, store_yaml, start = setup
    config = plugin_config([bundle], store_yaml, CHUNK, put_queue_chunks=3)
    kv = producer_kv()
    producer = start(PRODUCER, config, kv)
    plugin = scd_backend(producer)
    gate = __import__("threading").Event()
    run = plugin.service.puts._run
    plugin.service.puts._run = lambda job: (gate.wait(30), run(job))[1]  # hold the worker: puts pile up
    producer.store(torch.arange(TOKENS))  # 3 chunks: fit
    producer.store(torch.arange(1000, 1000 + TOKENS))  # 3 more: dropped, counted
    stats = plugin.service.store.stats
    assert stats.value("dropped_puts") == 3 and plugin.service.puts.queued_chunks() == 3
    gate.set()
    assert plugin.drain(timeout=30) and stats.value("puts") == 3


@pytest.mark.parametrize("change, match", [
    ({"scd.bundles": "/nonexistent"}, "not a calibration bundle"),
    ({"scd.positions": "batch"}, "positions come from the engine"),
    ({"scd.put_queue_chunks": 0}, "put_queue_chunks must be a positive int"),
    ({"scd.bundle": "x"}, "unknown scd-store settings"),
])
def test_bad_configuration_fails_at_construction(setup, change, match):
    bundle, store_yaml, _ = setup
    config = plugin_config([bundle], store_yaml, CHUNK)
    config.extra_config.update(change)
    from lmcache.v1.metadata import LMCacheMetadata

    metadata = LMCacheMetadata(model_name=PRODUCER, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.float16, kv_shape=(LAYOUT.num_layers, 2, CHUNK, HEADS, DIM))
    with pytest.raises(SettingsError, match=match):
        ScdStoragePlugin(dst_device="cpu", config=config, metadata=metadata, local_cpu_backend=object())


@pytest.mark.parametrize("algorithm", ["builtin", "no-such-hash"])
def test_a_chunk_hash_a_tenant_could_invert_is_refused(setup, algorithm):
    """LMCache's default chunk hash is Python's hash of token tuples: a tenant could craft a prompt that hashes like
    another's and have its KV coded under that key, signed by the producer and served to every consumer."""
    bundle, store_yaml, _ = setup
    config = plugin_config([bundle], store_yaml, CHUNK)
    config.pre_caching_hash_algorithm = algorithm
    from lmcache.v1.metadata import LMCacheMetadata

    metadata = LMCacheMetadata(model_name=PRODUCER, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.float16, kv_shape=(LAYOUT.num_layers, 2, CHUNK, HEADS, DIM))
    with pytest.raises(SettingsError, match="not cryptographic"):
        ScdStoragePlugin(dst_device="cpu", config=config, metadata=metadata, local_cpu_backend=object())


def test_engine_shape_that_does_not_fit_the_space_fails(setup):
    bundle, store_yaml, _ = setup
    config = plugin_config([bundle], store_yaml, CHUNK)
    from lmcache.v1.metadata import LMCacheMetadata

    metadata = LMCacheMetadata(model_name="consumer-a", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.float16, kv_shape=(5, 2, CHUNK, HEADS, DIM))
    with pytest.raises(SettingsError, match="does not match space"):
        ScdStoragePlugin(dst_device="cpu", config=config, metadata=metadata, local_cpu_backend=object())


def test_kv_the_space_cannot_code_is_not_stored(setup, caplog):
    kv = producer_kv()
    kv[0, 0, 20, 0] = float("nan")  # inside chunk 1
    refused_store(setup, caplog, kv, torch.arange(50, 50 + TOKENS), "NaN or inf")


def test_the_async_lookup_and_load_hooks_answer_like_the_blocking_ones(setup):
    """LMCache with async loading awaits batched_async_contains and batched_get_non_blocking on its event loop."""
    import asyncio

    bundle, store_yaml, start = setup
    config = plugin_config([bundle], store_yaml, CHUNK)
    kv = producer_kv()
    tokens = torch.arange(500, 500 + TOKENS)
    producer = start(PRODUCER, config, kv)
    producer.store(tokens)
    assert scd_backend(producer).drain(timeout=30)
    consumer = start("consumer-a", config, torch.zeros_like(kv))
    plugin = scd_backend(consumer)
    keys = [key for _, _, key in consumer.token_database.process_tokens(tokens)]
    assert asyncio.run(plugin.batched_async_contains("lookup-1", keys)) == 3
    objs = asyncio.run(plugin.batched_get_non_blocking("lookup-1", keys))
    want = expected_consumer_kv(bundle, "consumer-a", kv)
    assert torch.equal(torch.cat([obj.tensor for obj in objs], dim=2), want)
    single = plugin.get_non_blocking(keys[0]).result(timeout=30)
    assert torch.equal(single.tensor, want[:, :, :CHUNK])
    for obj in [*objs, single]:
        obj.ref_count_down()
    absent = [key for _, _, key in consumer.token_database.process_tokens(torch.arange(9000, 9000 + CHUNK))]
    assert asyncio.run(plugin.batched_get_non_blocking("lookup-2", absent + keys)) == []  # no leading hit


def test_a_consumer_engine_that_chunks_differently_fails_loudly(setup, caplog):
    """Another chunk size is another hash chain: the consumer's plugin refuses to start and says why."""
    bundle, store_yaml, start = setup
    kv = producer_kv()
    producer = start(PRODUCER, plugin_config([bundle], store_yaml, CHUNK), kv)
    with caplog.at_level(logging.ERROR):
        consumer = start("consumer-a", plugin_config([bundle], store_yaml, CHUNK // 2), torch.zeros_like(kv))
    assert scd_backend(consumer) is None  # LMCache logs a plugin that fails to construct and goes on without it
    assert f"chunk size: producer {CHUNK}, here {CHUNK // 2}" in caplog.text
    assert scd_backend(producer).service.store.stats.value("hash_mismatch") == 1


def test_tenants_tagged_apart_never_read_each_others_codes(setup):
    bundle, store_yaml, start = setup
    config = plugin_config([bundle], store_yaml, CHUNK)
    kv = producer_kv()
    tokens = torch.arange(700, 700 + TOKENS)
    producer = start(PRODUCER, config, kv)
    producer.store(tokens, request_configs={"lmcache.tag.tenant": "acme"})
    assert scd_backend(producer).drain(timeout=30)
    consumer = start("consumer-a", config, torch.zeros_like(kv))
    assert consumer.lookup(tokens, request_configs={"lmcache.tag.tenant": "acme"}) == TOKENS
    assert consumer.lookup(tokens, request_configs={"lmcache.tag.tenant": "globex"}) == 0
    assert consumer.lookup(tokens) == 0  # untagged is a namespace of its own too


def test_a_lora_adapter_on_the_base_engine_reads_as_its_pair_and_never_writes(setup):
    """LMCache keys carry no LoRA id: on an engine that serves adapters a gateway names each request's
    consumer with the lmcache.tag.scd_model tag. Untagged, or naming the producer or another model, a
    request is unattributed; the engine never writes (no request of it is the base model's by the engine's word)."""
    bundle, store_yaml, start = setup
    config = plugin_config([bundle], store_yaml, CHUNK, serves_adapters=True)
    kv = producer_kv()
    tokens = torch.arange(900, 900 + TOKENS)
    base = start(PRODUCER, config, kv)  # one engine: the base model and its adapters
    plugin = scd_backend(base)
    stats = plugin.service.store.stats
    base.store(tokens)  # which model? unknown: not stored
    assert plugin.drain(timeout=30) and stats.value("puts") == 0 and stats.value("unattributed_chunks") == 3
    for model in (PRODUCER, "stranger", "consumer-a"):  # an adapter's own KV is never coded either
        base.store(tokens + 10_000, request_configs={MODEL_TAG: model})
    assert plugin.drain(timeout=30) and stats.value("puts") == 0 and stats.value("unattributed_chunks") == 9
    start(PRODUCER, plugin_config([bundle], store_yaml, CHUNK), kv).store(tokens)  # an engine without adapters
    assert plugin.drain(timeout=30) and stats.value("puts") == 3
    want = expected_consumer_kv(bundle, "consumer-a", kv)
    out = torch.zeros_like(kv)
    reader = start(PRODUCER, config, out)  # LMCache's own tiers of this engine hold nothing
    for model in (None, PRODUCER, "stranger"):
        assert reader.lookup(tokens, request_configs={MODEL_TAG: model} if model else None) == 0
    assert stats.value("unattributed_chunks") == 9 + 3 * 3
    adapter = {MODEL_TAG: "consumer-a"}
    assert reader.lookup(tokens, request_configs=adapter) == TOKENS
    reader.retrieve(tokens, request_configs=adapter)
    assert torch.equal(out, want)
    assert reader.lookup(torch.arange(5000, 5000 + TOKENS), request_configs=adapter) == 0


def test_a_tenant_tagging_the_producer_on_a_consumer_engine_stores_nothing(setup, caplog):
    """The attack: a consumer engine's client names the producer in its model tag, so that its own KV
    would be coded into the producer's space under the key untagged tenants read. Roles come from the
    engine: the tag is ignored (counted, logged once), nothing is stored, the producer's space gets nothing."""
    bundle, store_yaml, start = setup
    config = plugin_config([bundle], store_yaml, CHUNK)
    kv = producer_kv()
    tokens = torch.arange(1100, 1100 + TOKENS)
    attacker = start("consumer-a", config, torch.randn_like(kv))
    plugin = scd_backend(attacker)
    stats = plugin.service.store.stats
    with caplog.at_level(logging.WARNING, logger="scd_store.adapters.lmcache"):
        attacker.store(tokens, request_configs={MODEL_TAG: PRODUCER})
        attacker.store(tokens, request_configs={MODEL_TAG: PRODUCER, "lmcache.tag.tenant": "acme"})
        assert plugin.drain(timeout=30)
    assert stats.value("puts") == 0 and stats.value("ignored_model_tags") == 2  # one per request
    assert caplog.text.count("the tag is ignored") == 1
    victim = start("consumer-b", config, torch.zeros_like(kv))
    for tags in (None, {MODEL_TAG: PRODUCER}, {"lmcache.tag.tenant": "acme"}):
        assert victim.lookup(tokens, request_configs=tags) == 0
    producer = start(PRODUCER, config, kv)  # the producer's own store is what the victim then reads
    producer.store(tokens, request_configs={MODEL_TAG: "consumer-a"})  # its tag is ignored too: the producer's
    assert plugin.drain(timeout=30) and stats.value("puts") == 3
    assert victim.lookup(tokens) == TOKENS  # under the untagged key: the tag never entered the namespace
    out = torch.zeros_like(kv)
    start("consumer-a", config, out).retrieve(tokens)
    assert torch.equal(out, expected_consumer_kv(bundle, "consumer-a", kv))


def test_salted_requests_are_neither_stored_nor_served(setup):
    """A request with a vLLM cache_salt carries LMCacheCpuConnector's salt tag: the plugin refuses every
    such key (LMCache's keys carry no salt it could keep tenants apart by) and counts it."""
    bundle, store_yaml, start = setup
    config = plugin_config([bundle], store_yaml, CHUNK)
    kv = producer_kv()
    tokens = torch.arange(1300, 1300 + TOKENS)
    salted = {SALT_TAG_CONFIG: "0123456789abcdef0123456789abcdef"}
    producer = start(PRODUCER, config, kv)
    plugin = scd_backend(producer)
    stats = plugin.service.store.stats
    producer.store(tokens, request_configs=salted)
    assert plugin.drain(timeout=30) and stats.value("puts") == 0
    stored_salted = stats.value("salted_chunks")
    assert stored_salted >= 3
    consumer = start("consumer-a", config, torch.zeros_like(kv))
    assert consumer.lookup(tokens) == 0  # nothing went under the unsalted key either
    producer.store(tokens)
    assert plugin.drain(timeout=30) and stats.value("puts") == 3
    assert consumer.lookup(tokens) == TOKENS
    assert consumer.lookup(tokens, request_configs=salted) == 0  # a salted reader never gets the unsalted codes
    assert stats.value("salted_chunks") > stored_salted
    keys = [key for _, _, key in consumer.token_database.process_tokens(tokens, request_configs=salted)]
    assert scd_backend(consumer).batched_get_blocking(keys) == [None] * 3


def test_an_engine_that_serves_lora_adapters_never_writes_whatever_its_settings(setup, monkeypatch):
    """LMCache keys carry no LoRA id: on an --enable-lora engine (scd-store's vLLM connector says so) a tenant
    choosing an adapter would get the adapter's KV stored under the base model's keys."""
    from scd_store.adapters.vllm.lmcache_cpu import mark_lora_engine
    from scd_store.service import engine_facts

    monkeypatch.setattr(engine_facts, "_serves_lora", False)  # restored after the test (said for the whole process)
    assert not mark_lora_engine(SimpleNamespace(lora_config=None)) and not engine_facts.serves_lora()
    assert mark_lora_engine(SimpleNamespace(lora_config=object())) and engine_facts.serves_lora()
    bundle, store_yaml, start = setup
    base = start(PRODUCER, plugin_config([bundle], store_yaml, CHUNK), producer_kv())  # serves_adapters unset
    plugin = scd_backend(base)
    assert plugin.serves_adapters
    base.store(torch.arange(1300, 1300 + TOKENS))
    assert plugin.drain(timeout=30) and plugin.service.store.stats.value("puts") == 0
