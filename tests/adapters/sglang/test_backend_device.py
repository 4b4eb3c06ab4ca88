"""The SGLang backend, built by SGLang's own ``StorageBackendFactory`` (``dynamic``), with ``decode_device`` and
quantised host pools: a consumer's pages decode through the backend's :class:`DeviceDecode` and are written
into the host pool only after its stream is synchronised; ``decode_device`` cuda without CUDA and fp8 / mxfp8
pools are refused at start, and a refused pool is never read or written.

The host pools are :mod:`tests.adapters.sglang.host_pool`'s stand-in (SGLang's classes do not import here); the
CUDA stream is an injected recorder on the CPU (the real one: ``test_device`` and ``test_reads_cuda``)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("sglang", reason="the SGLang backend needs the SGLang stack (`make test`)")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

from scd_store.adapters.sglang.backend import ScdHiCacheStorage  # noqa: E402
from scd_store.adapters.sglang.device import DeviceDecode  # noqa: E402
from scd_store.adapters.sglang.pages import flat_page  # noqa: E402
from scd_store.codecs.kv_state import KVState  # noqa: E402
from scd_store.service import SettingsError  # noqa: E402
from tests.adapters.sglang.host_pool import PAGE, HostPool, MXFP8HostPool  # noqa: E402
from tests.adapters.sglang.test_device import recording_decode  # noqa: E402
from tests.bundles import PRODUCER, correlated_state, write_tiny_bundle  # noqa: E402

PAGES = 3
LOGGER = "scd_store.adapters.sglang"
KEYS = get_hash_str(list(range(PAGES * PAGE)), None, page_size=PAGE)


def make_backend(model: str, bundle, **scd) -> ScdHiCacheStorage:
    extra = {"backend_name": "scd", "module_path": "scd_store.adapters.sglang.backend",
             "class_name": "ScdHiCacheStorage", "interface_v1": 1, "hicache_storage_pass_prefix_keys": True,
             "scd": {"bundles": [str(bundle)], **scd}}
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name=model, extra_config=extra)
    return StorageBackendFactory.create_backend("dynamic", config, None)


@pytest.fixture
def bundle(tmp_path, monkeypatch):
    monkeypatch.setenv("SCD_STORE_HOME", str(tmp_path / "home"))  # the embedded store, this test's own
    write_tiny_bundle(tmp_path / "bundle", consumers=("consumer-a",))
    return tmp_path / "bundle"


def produce(bundle) -> ScdHiCacheStorage:
    """A producer backend that wrote back :data:`KEYS` (drained); the caller closes it."""
    producer = make_backend(PRODUCER, bundle)
    pool = HostPool()
    producer.register_mem_pool_host(pool)
    state = correlated_state(PAGES * PAGE, seed=4)
    for p in range(PAGES):
        part = KVState(state.keys[:, :, p * PAGE:(p + 1) * PAGE], state.values[:, :, p * PAGE:(p + 1) * PAGE])
        pool.set_from_flat_data_page(p * PAGE, flat_page(part, pool.layout, pool.dtype))
    assert producer.batch_set_v1(KEYS, torch.arange(PAGES * PAGE), HiCacheStorageExtraInfo(prefix_keys=[])) == [
        True] * PAGES
    assert producer.drain(timeout=30)
    return producer


def test_the_default_decodes_on_the_cpu(bundle):
    backend = make_backend("consumer-a", bundle)
    assert type(backend.decode) is DeviceDecode and backend.decode.device == torch.device("cpu")
    backend.close()


def test_decode_device_cuda_without_cuda_fails_the_start(bundle, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with (caplog.at_level(logging.ERROR, logger=LOGGER),
          pytest.raises(SettingsError, match="decode_device is 'cuda' but CUDA is not available")):
        make_backend("consumer-a", bundle, decode_device="cuda")
    assert "bad configuration: decode_device" in caplog.text


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_decoded_on_a_stream_are_written_after_it_is_synchronised_and_equal_the_cpu_decode(bundle, layout,
                                                                                            monkeypatch):
    producer = produce(bundle)
    plain = make_backend("consumer-a", bundle)
    want = HostPool(layout)
    plain.register_mem_pool_host(want)
    assert plain.batch_get_v1(KEYS, torch.arange(PAGES * PAGE)) == [True] * PAGES
    log: list[str] = []
    streamed = make_backend("consumer-a", bundle)
    streamed.decode, _ = recording_decode(log)
    pool = HostPool(layout)
    streamed.register_mem_pool_host(pool)
    real_get, real_write = streamed.service.get, pool.set_from_flat_data_page
    monkeypatch.setattr(streamed.service, "get", lambda *a, **k: log.append(f"get {sorted(k)}") or real_get(*a, **k))
    monkeypatch.setattr(pool, "set_from_flat_data_page", lambda i, page: log.append(f"write {i}") or real_write(
        i, page))
    assert streamed.batch_get_v1(KEYS, torch.arange(PAGES * PAGE)) == [True] * PAGES
    assert log == ["enter", "get ['into']", "exit", "sync"] + [f"write {p * PAGE}" for p in range(PAGES)]
    assert torch.equal(pool.kv_buffer[:, :PAGES * PAGE] if layout == "page_first" else pool.kv_buffer,
                       want.kv_buffer[:, :PAGES * PAGE] if layout == "page_first" else want.kv_buffer)
    assert pool.kv_buffer.abs().sum() > 0
    log.clear()  # the flat-page interface reads through the same decode
    flats = streamed.batch_get(KEYS)
    assert log[:4] == ["enter", "get ['into']", "exit", "sync"]
    assert all(torch.equal(f, want.get_data_page(i * PAGE)) for i, f in enumerate(flats))
    for backend in (producer, plain, streamed):
        backend.close()


@pytest.mark.parametrize("model", [PRODUCER, "consumer-a"])
@pytest.mark.parametrize("make_pool", [lambda: HostPool(dtype=torch.uint8), lambda: HostPool(dtype=torch.float8_e4m3fn),
                                       MXFP8HostPool], ids=["fp8-as-uint8", "fp8", "mxfp8"])
def test_a_quantised_pool_fails_the_start_and_is_never_read_or_written(bundle, model, make_pool, caplog):
    producer = produce(bundle) if model != PRODUCER else None
    backend = make_backend(model, bundle)
    pool = make_pool()
    refused = r"host pool dtype torch\.(uint8|float8_e4m3fn) .*--kv-cache-dtype bf16"
    with caplog.at_level(logging.ERROR, logger=LOGGER), pytest.raises(SettingsError, match=refused):
        backend.register_mem_pool_host(pool)
    assert "scd-store SGLang backend: host pool dtype" in caplog.text
    assert backend.mem_pool_host is None
    indices = torch.arange(PAGES * PAGE)
    if model == PRODUCER:  # nothing read from the pool, nothing stored
        assert backend.batch_set_v1(KEYS, indices, HiCacheStorageExtraInfo(prefix_keys=[])) == [False] * PAGES
        backend.drain(timeout=30)
        consumer = make_backend("consumer-a", bundle)
        consumer.register_mem_pool_host(HostPool())
        assert consumer.batch_exists(KEYS) == 0
        consumer.close()
    else:  # the codes are there, but nothing is written into the refused pool
        assert backend.batch_exists(KEYS) == PAGES
        assert backend.batch_get_v1(KEYS, indices) == [False] * PAGES and backend.batch_get(KEYS) == [None] * PAGES
        assert pool.writes == [] and not pool.kv_buffer.view(torch.uint8).any()
    for each in (producer, backend):
        if each is not None:
            each.close()
