"""The scd-store HiCache backend, loaded by SGLang's own StorageBackendFactory (``dynamic``), on CPU."""

from __future__ import annotations

import hashlib
import logging

import pytest
import torch

pytest.importorskip("sglang", reason="the SGLang stack is installed by `make test`")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from integration_tests.lmcache_engines import write_store_yaml  # noqa: E402
from scd_store.adapters.sglang.backend import ScdHiCacheStorage  # noqa: E402
from scd_store.adapters.sglang.pages import flat_page  # noqa: E402
from scd_store.codecs.scd.bundle import load_pair, load_space  # noqa: E402
from scd_store.codecs.scd.codec import ScdCodec  # noqa: E402
from scd_store.service import SettingsError  # noqa: E402
from tests.bundles import LAYOUT, PRODUCER, correlated_state, write_tiny_bundle  # noqa: E402

PAGE, PAGES = 8, 4
L, H, D = LAYOUT.num_layers, LAYOUT.kv_heads, LAYOUT.head_dim


class HostPool:
    """The part of SGLang's MHA host pool a storage backend touches (its real class needs torchvision to
    import here): a ``[2, layers, tokens, heads, dim]`` (layer_first) or ``[2, tokens, layers, heads, dim]``
    (page_first) buffer and the page accessors with SGLang's shapes."""

    def __init__(self, layout: str, tokens: int = 64, dtype=torch.float16) -> None:
        self.layout, self.page_size, self.dtype = layout, PAGE, dtype
        self.layer_num, self.head_num, self.head_dim = L, H, D
        dims = (2, L, tokens, H, D) if layout == "layer_first" else (2, tokens, L, H, D)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = (self.kv_buffer[:, :, index:index + PAGE] if self.layout == "layer_first"
                else self.kv_buffer[:, index:index + PAGE])
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + PAGE] = data_page.reshape(2, L, PAGE, H, D)
        else:
            self.kv_buffer[:, index:index + PAGE] = data_page.reshape(2, PAGE, L, H, D)

    def state_tokens(self, index: int) -> torch.Tensor:
        """``[2, L, H, PAGE, D]`` of the page at ``index`` (layout-independent view for checks)."""
        page = self.get_data_page(index, flat=False)
        return page.permute(0, 1, 3, 2, 4) if self.layout == "layer_first" else page.permute(0, 2, 3, 1, 4)


def page_keys(n: int) -> list[str]:
    keys, parent = [], b""
    for i in range(n):
        parent = hashlib.sha256(parent + bytes([i]) * PAGE).digest()
        keys.append(parent.hex())
    return keys


def make_backend(model: str, bundle, store_yaml, prefix_keys: bool | None = True, **scd) -> ScdHiCacheStorage:
    extra = {"backend_name": "scd", "module_path": "scd_store.adapters.sglang.backend",
             "class_name": "ScdHiCacheStorage", "interface_v1": 1,
             "scd": {"bundles": [str(bundle)], "store_config": str(store_yaml), **scd}}
    if prefix_keys is not None:
        extra["hicache_storage_pass_prefix_keys"] = prefix_keys
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name=model, extra_config=extra)
    return StorageBackendFactory.create_backend("dynamic", config, None)


@pytest.fixture
def env(tmp_path):
    bundle = tmp_path / "bundle"
    write_tiny_bundle(bundle, consumers=("consumer-a", "consumer-b"))
    return bundle, write_store_yaml(tmp_path / "store.yaml", tmp_path / "disk")


def fill_producer(pool: HostPool, host_base: int, seed: int = 3) -> torch.Tensor:
    """Write PAGES pages of producer KV at host indices from ``host_base``; return them ``[2, L, H, T, D]``."""
    state = correlated_state(PAGES * PAGE, seed=seed)
    kv = torch.stack([state.keys, state.values]).half()
    for p in range(PAGES):
        part = kv[:, :, :, p * PAGE:(p + 1) * PAGE]
        pool.set_from_flat_data_page(host_base + p * PAGE, flat_page(
            type(state)(part[0].float(), part[1].float(), start=0), pool.layout, pool.dtype))
    return kv


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
