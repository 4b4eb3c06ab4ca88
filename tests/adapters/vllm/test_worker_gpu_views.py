"""The worker half on vLLM's CUDA backends' cache views (FlashAttention / Triton code, strided
``KVCacheLayout`` views, kernel blocks split from manager blocks), on the CPU: a producer's save
reads what the engine wrote, a consumer's load lands where the engine's kernel reads, and a load
that fails for any reason is recomputed, never a failed step."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from scd_store.adapters.vllm.plan import ChunkLoad, ChunkSave, StepPlan, slots_of  # noqa: E402
from scd_store.adapters.vllm.worker_side import WorkerSide  # noqa: E402
from tests.adapters.vllm.gpu_layers import engine_views, gpu_layer, patch_cache_ops  # noqa: E402

HEADS, DIM, BLOCK, BLOCKS, LAYERS, CHUNK = 2, 16, 32, 8, 2, 64
CASES = [("FLASH_ATTN", KVCacheLayout.LBNHC, None), ("FLASH_ATTN", KVCacheLayout.BLNHC, None),
         ("TRITON_ATTN", KVCacheLayout.LBHNC, BLOCK // 2), ("FLASH_ATTN", KVCacheLayout.LBNHC, BLOCK // 2)]


@pytest.fixture(autouse=True)
def reference_op(monkeypatch):
    patch_cache_ops(monkeypatch)


def _worker(service, backend, layout, kernel):
    views = engine_views(layout, torch.bfloat16, layers=LAYERS, blocks=BLOCKS, block_size=BLOCK, heads=HEADS,
                         head_dim=DIM, kernel_block_size=kernel)
    layers = [gpu_layer(backend, HEADS, DIM) for _ in views]
    worker = WorkerSide(service)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker.register(dict(zip(names, views, strict=True)), dict(zip(names, layers, strict=True)))
    return worker, views, layers


@pytest.mark.parametrize("backend,layout,kernel", CASES, ids=[f"{b}-{lay.name}-k{k}" for b, lay, k in CASES])
def test_a_save_reads_what_the_engine_wrote_and_a_load_lands_where_its_kernel_reads(backend, layout, kernel):
    submitted = []
    service = types.SimpleNamespace(submit_put=lambda model, hashes, states, **kw: submitted.append((states, kw))
                                    or True, put_fits=lambda chunks, nbytes: True)
    worker, views, layers = _worker(service, backend, layout, kernel)
    request_blocks = [5, 1, 6, 2]  # manager blocks
    slots = torch.tensor(slots_of(request_blocks, BLOCK, 0, 4 * BLOCK))
    written = [(torch.randn(4 * BLOCK, HEADS, DIM).bfloat16(), torch.randn(4 * BLOCK, HEADS, DIM).bfloat16())
               for _ in layers]
    for layer, cache, (k, v) in zip(layers, views, written, strict=True):
        layer.impl.do_kv_cache_update(layer, k, v, cache, slots)  # the engine's own write
    worker._save_one(ChunkSave("r1", "producer", [b"\x01" * 16, b"\x02" * 16], [0, CHUNK],
                               [slots.tolist()[:CHUNK], slots.tolist()[CHUNK:]]))
    states, kwargs = submitted[0]
    assert kwargs["nbytes"] == 4 * BLOCK * HEADS * 2 * DIM * 2 * LAYERS  # the bytes of KV the job holds
    for view in views:
        view.zero_()  # the engine reuses the blocks at once
    for i, state in enumerate(states()):
        part = slice(i * CHUNK, (i + 1) * CHUNK)
        for layer, (k, v) in enumerate(written):
            assert torch.equal(state.keys[layer], k[part].float().transpose(0, 1))
            assert torch.equal(state.values[layer], v[part].float().transpose(0, 1))

    decoded = [(torch.randn(LAYERS, HEADS, CHUNK, DIM).bfloat16(), torch.randn(LAYERS, HEADS, CHUNK, DIM).bfloat16())
               for _ in range(2)]

    def get(model, hashes, into):
        for i in range(len(hashes)):
            keys, values = into(i, CHUNK)
            assert keys.device == views[0].device and keys.dtype == views[0].dtype  # decoded on the cache's device
            keys.copy_(decoded[i][0])
            values.copy_(decoded[i][1])
        return list(hashes)

    worker.service = types.SimpleNamespace(get=get, observe=lambda *a: None)
    blocks = [3, 7, 0, 4]
    worker.load(StepPlan(loads=[ChunkLoad("r2", "consumer", [b"\x03" * 16, b"\x04" * 16], CHUNK, 0, blocks, BLOCK)]))
    assert worker.failed_blocks() == set()
    load_slots = torch.tensor(slots_of(blocks, BLOCK, 0, 2 * CHUNK))
    for layer, view in enumerate(views):
        k_cache, v_cache = view.transpose(1, 2).split(DIM, dim=-1)  # how the backend's kernel reads its cache
        n = view.shape[2]  # the kernel's block
        want_k = torch.cat([d[0][layer] for d in decoded], 1).transpose(0, 1)
        want_v = torch.cat([d[1][layer] for d in decoded], 1).transpose(0, 1)
        assert torch.equal(k_cache[load_slots // n, load_slots % n], want_k)
        assert torch.equal(v_cache[load_slots // n, load_slots % n], want_v)


def test_a_load_that_fails_in_any_way_is_recomputed_never_a_failed_step():
    def get(model, hashes, into):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    observed = []
    worker, views, _ = _worker(types.SimpleNamespace(get=get, observe=lambda *a: observed.append(a)), "FLASH_ATTN",
                               KVCacheLayout.LBNHC, None)
    blocks = [3, 7, 0, 4]
    worker.load(StepPlan(loads=[ChunkLoad("r", "consumer", [b"\x03" * 16, b"\x04" * 16], CHUNK, 0, blocks, BLOCK)]))
    assert worker.failed_blocks() == set(blocks) and len(observed) == 1
    assert all(bool((v == 0).all()) for v in views)
