"""The scd-store HiCache backend, loaded by SGLang's own StorageBackendFactory (``dynamic``), on CPU."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("sglang", reason="the SGLang stack is installed by `make test`")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from integration_tests.lmcache_engines import write_store_yaml  # noqa: E402
from integration_tests.sglang_harness import (  # noqa: E402
    PAGE,
    PAGES,
    HostPool,
    fill_producer,
    make_backend,
    page_keys,
)
from scd_store.adapters.sglang.backend import ScdHiCacheStorage  # noqa: E402
from scd_store.codecs.scd.bundle import load_pair, load_space  # noqa: E402
from scd_store.codecs.scd.codec import ScdCodec  # noqa: E402
from scd_store.service import SettingsError  # noqa: E402
from tests.bundles import PRODUCER, write_tiny_bundle  # noqa: E402


@pytest.fixture
def env(tmp_path):
    bundle = tmp_path / "bundle"
    write_tiny_bundle(bundle, consumers=("consumer-a", "consumer-b"))
    return bundle, write_store_yaml(tmp_path / "store.yaml", tmp_path / "disk")


def expected(bundle, consumer: str, kv: torch.Tensor) -> torch.Tensor:
    space = load_space(bundle)
    codec = ScdCodec(space, load_pair(bundle, consumer, space))
    pages = []
    for p in range(PAGES):
        part = kv[:, :, :, p * PAGE:(p + 1) * PAGE].float()
        out = codec.decode(codec.encode(type_state(part, p * PAGE)))
        pages.append(torch.stack([out.keys, out.values]).half())
    return torch.cat(pages, dim=3)


def type_state(part, start):
    from scd_store.codecs.kv_state import KVState

    return KVState(part[0].contiguous(), part[1].contiguous(), start=start)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_consumer_prefetch_gets_its_decode_of_the_producer_pages(env, layout):
    bundle, store_yaml = env
    producer = make_backend(PRODUCER, bundle, store_yaml)
    assert isinstance(producer, ScdHiCacheStorage)
    pool = HostPool(layout)
    producer.register_mem_pool_host(pool)
    kv = fill_producer(pool, host_base=16)
    keys = page_keys(PAGES)
    indices = torch.arange(16, 16 + PAGES * PAGE)
    # two write-back batches: the second one's position comes from prefix_keys
    assert producer.batch_set_v1(keys[:2], indices[:2 * PAGE], HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 2
    assert producer.batch_set_v1(keys[2:], indices[2 * PAGE:], HiCacheStorageExtraInfo(prefix_keys=keys[:2])) == [
        True] * 2
    pool.kv_buffer.zero_()  # SGLang may reuse its host pages once a write-back call returns: they were copied
    assert producer.drain(timeout=30)
    consumer = make_backend("consumer-b", bundle, store_yaml)
    cpool = HostPool(layout)
    consumer.register_mem_pool_host(cpool)
    assert consumer.batch_exists(keys) == PAGES and consumer.exists(keys[0])
    assert consumer.batch_get_v1(keys, torch.arange(PAGES * PAGE), HiCacheStorageExtraInfo(prefix_keys=[])) == [
        True] * PAGES
    want = expected(bundle, "consumer-b", kv)
    got = torch.cat([cpool.state_tokens(p * PAGE) for p in range(PAGES)], dim=3)
    assert torch.equal(got, want)
    # the flat-page interface returns the same pages, in the pool's layout
    flats = consumer.batch_get(keys)
    assert all(torch.equal(f, cpool.get_data_page(i * PAGE)) for i, f in enumerate(flats))
    target = torch.empty_like(cpool.get_data_page(0))
    assert consumer.get(keys[1], target) is target and torch.equal(target, cpool.get_data_page(PAGE))
    for backend in (producer, consumer):
        backend.close()


def test_unknown_models_producers_and_missing_positions_miss(env, caplog):
    bundle, store_yaml = env
    producer = make_backend(PRODUCER, bundle, store_yaml)
    pool = HostPool("layer_first")
    producer.register_mem_pool_host(pool)
    fill_producer(pool, host_base=0)
    keys = page_keys(PAGES)
    with caplog.at_level(logging.WARNING, logger="scd_store.adapters.sglang"):
        assert producer.batch_set_v1(keys, torch.arange(PAGES * PAGE), None) == [False] * PAGES
        stranger = make_backend("stranger", bundle, store_yaml)
    assert "page positions are unknown" in caplog.text and "is in no bundle" in caplog.text
    assert producer.service.store.stats.value("unpositioned_chunks") == PAGES
    assert producer.batch_set_v1(keys, torch.arange(PAGES * PAGE), HiCacheStorageExtraInfo(prefix_keys=[])) == [
        True] * PAGES
    assert producer.drain(timeout=30)
    stranger.register_mem_pool_host(HostPool("layer_first"))
    assert stranger.batch_exists(keys) == 0
    assert stranger.batch_get_v1(keys, torch.arange(PAGES * PAGE)) == [False] * PAGES
    assert producer.batch_exists(keys) == 0  # the producer's own L3 pages are raw, not coded
    consumer = make_backend("consumer-a", bundle, store_yaml)
    consumer.register_mem_pool_host(HostPool("layer_first"))
    assert consumer.batch_exists(keys) == PAGES
    assert consumer.batch_exists(["ff" * 32] + keys) == 0  # a missing first page: no leading hit
    assert consumer.set(keys[0], pool.get_data_page(0)) is False  # consumers never write
    for backend in (producer, stranger, consumer):
        backend.close()


def test_get_stats_gives_sglang_its_storage_metrics(env, monkeypatch):
    """With --enable-storage-metrics SGLang asserts isinstance(get_stats(), StorageMetrics) (or makes one
    when it gets None) and sets prefetch_stats on it. Its metrics module needs torchvision, which this
    CPU machine lacks, so the class is stood in for by one with the same fields."""
    import dataclasses
    import sys
    import types

    bundle, store_yaml = env
    backend = make_backend("consumer-a", bundle, store_yaml)
    try:
        __import__("sglang.srt.observability.metrics_collector")
        importable = True
    except Exception:
        importable = False
    if not importable:
        assert backend.get_stats() is None  # SGLang builds its own StorageMetrics then

        @dataclasses.dataclass
        class StorageMetrics:
            prefetch_pgs: list = dataclasses.field(default_factory=list)
            backup_pgs: list = dataclasses.field(default_factory=list)
            prefetch_bandwidth: list = dataclasses.field(default_factory=list)
            backup_bandwidth: list = dataclasses.field(default_factory=list)

        monkeypatch.setitem(sys.modules, "sglang.srt.observability.metrics_collector",
                            types.SimpleNamespace(StorageMetrics=StorageMetrics))
    from sglang.srt.observability.metrics_collector import StorageMetrics

    metrics = backend.get_stats()
    assert isinstance(metrics, StorageMetrics) and "counters" in metrics.scd_store
    metrics.prefetch_stats = {}
    backend.close()


def test_flat_pages_carry_no_positions_and_are_not_stored(env):
    bundle, store_yaml = env
    producer = make_backend(PRODUCER, bundle, store_yaml)
    pool = HostPool("page_first")
    producer.register_mem_pool_host(pool)
    fill_producer(pool, host_base=0)
    keys = page_keys(PAGES)
    assert producer.batch_set(keys, [pool.get_data_page(p * PAGE) for p in range(PAGES)]) is False
    assert producer.service.store.stats.value("unpositioned_chunks") == PAGES
    consumer = make_backend("consumer-a", bundle, store_yaml)
    consumer.register_mem_pool_host(HostPool("page_first"))
    assert consumer.batch_exists(keys) == 0
    for backend in (producer, consumer):
        backend.close()


def test_bad_configuration_and_unsupported_engines_fail_loudly(env):
    bundle, store_yaml = env
    with pytest.raises(SettingsError, match='"scd" object'):
        StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=False, model_name=PRODUCER,
            extra_config={"backend_name": "scd", "module_path": "scd_store.adapters.sglang.backend",
                          "class_name": "ScdHiCacheStorage"}), None)
    with pytest.raises(SettingsError, match="unknown scd-store settings"):
        make_backend(PRODUCER, bundle, store_yaml, bundle_dirs=["x"])
    for flag in (None, False):  # SGLang passes no page positions without it
        with pytest.raises(SettingsError, match='set "hicache_storage_pass_prefix_keys": true'):
            make_backend(PRODUCER, bundle, store_yaml, prefix_keys=flag)
    backend = make_backend("consumer-a", bundle, store_yaml)
    wrong = HostPool("layer_first")
    wrong.layer_num = 5
    with pytest.raises(SettingsError, match="does not match space"):
        backend.register_mem_pool_host(wrong)
    odd = HostPool("layer_first")
    odd.layout = "page_unified"
    with pytest.raises(SettingsError, match="not supported"):
        backend.register_mem_pool_host(odd)
    backend.close()


def test_a_consumer_with_another_page_size_fails_loudly(env):
    bundle, store_yaml = env
    producer = make_backend(PRODUCER, bundle, store_yaml)
    producer.register_mem_pool_host(HostPool("layer_first"))  # records the producer's page hashing
    consumer = make_backend("consumer-a", bundle, store_yaml)
    other = HostPool("layer_first")
    other.page_size = PAGE // 2
    with pytest.raises(SettingsError, match=f"chunk size: producer {PAGE}, here {PAGE // 2}"):
        consumer.register_mem_pool_host(other)
    for backend in (producer, consumer):
        backend.close()


def test_tenant_namespaces_keep_pages_apart_and_an_adapter_serving_producer_stores_nothing(env):
    """SGLang seeds a request's page chain with its namespace (extra_key, which carries the LoRA id, and
    cache_salt): the same tokens of two tenants are other keys. A storage backend is told no request's
    identity, so on a server that serves adapters nothing can be attributed to the base model."""
    from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

    bundle, store_yaml = env
    tokens = list(range(PAGES * PAGE))
    acme = get_hash_str(tokens, storage_namespace_seed("acme", None), page_size=PAGE)
    globex = get_hash_str(tokens, storage_namespace_seed("globex", None), page_size=PAGE)
    producer = make_backend(PRODUCER, bundle, store_yaml)
    pool = HostPool("layer_first")
    producer.register_mem_pool_host(pool)
    fill_producer(pool, host_base=0)
    assert producer.batch_set_v1(acme, torch.arange(PAGES * PAGE), HiCacheStorageExtraInfo(prefix_keys=[])) == [
        True] * PAGES
    assert producer.drain(timeout=30)
    consumer = make_backend("consumer-a", bundle, store_yaml)
    consumer.register_mem_pool_host(HostPool("layer_first"))
    assert consumer.batch_exists(acme) == PAGES and consumer.batch_exists(globex) == 0
    serving = make_backend(PRODUCER, bundle, store_yaml, serves_adapters=True)
    serving.register_mem_pool_host(pool)
    assert serving.batch_set_v1(globex, torch.arange(PAGES * PAGE), HiCacheStorageExtraInfo(prefix_keys=[])) == [
        False] * PAGES
    assert serving.service.store.stats.value("unattributed_chunks") == PAGES
    for backend in (producer, consumer, serving):
        backend.close()
