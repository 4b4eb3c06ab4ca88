"""The worker half on vLLM's CUDA backends' cache views (FlashAttention / Triton code, strided
``KVCacheLayout`` views, kernel blocks split from manager blocks), on the CPU: a producer's save
reads what the engine wrote, a consumer's load lands where the engine's kernel reads (decoded
straight into the blocks through a slot table, or through buffers and the backend's op: the same
bytes), and a load that fails for any reason is recomputed, never a failed step."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from scd_store.adapters.vllm.plan import ChunkLoad, ChunkSave, StepPlan, slots_of  # noqa: E402
from scd_store.adapters.vllm.worker_side import WorkerSide  # noqa: E402
from scd_store.codecs.head_share import HeadShare  # noqa: E402
from scd_store.codecs.paged import scatter_eager  # noqa: E402
from scd_store.service import KVService  # noqa: E402
from scd_store.store.registry import FileRegistry  # noqa: E402
from scd_store.store.tiered import TieredStore  # noqa: E402
from scd_store.store.tiers.cpu import CpuTier  # noqa: E402
from tests.adapters.vllm.gpu_layers import engine_views, gpu_layer, patch_cache_ops  # noqa: E402
from tests.bundles import LAYOUT, PRODUCER, chunked, write_tiny_bundle  # noqa: E402

HEADS, DIM, BLOCK, BLOCKS, LAYERS, CHUNK = 2, 16, 32, 8, 2, 64
CASES = [("FLASH_ATTN", KVCacheLayout.LBNHC, None), ("FLASH_ATTN", KVCacheLayout.BLNHC, None),
         ("TRITON_ATTN", KVCacheLayout.LBHNC, BLOCK // 2), ("FLASH_ATTN", KVCacheLayout.LBNHC, BLOCK // 2)]


@pytest.fixture(autouse=True)
def reference_op(monkeypatch):
    patch_cache_ops(monkeypatch)


def _worker(service, backend, layout, kernel, *, heads=HEADS, dim=DIM, dtype=torch.bfloat16, paged=True,
            share=None):
    views = engine_views(layout, dtype, layers=LAYERS, blocks=BLOCKS, block_size=BLOCK, heads=heads,
                         head_dim=dim, kernel_block_size=kernel)
    layers = [gpu_layer(backend, heads, dim) for _ in views]
    worker = WorkerSide(service)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker.register(dict(zip(names, views, strict=True)), dict(zip(names, layers, strict=True)), share)
    assert worker.paged() is not None  # the backends' op writes [K | V] where the slot-table load writes
    if not paged:
        worker._paged = (None,)  # through buffers and the backend's op, as on vLLM-CPU
    return worker, views, layers


@pytest.mark.parametrize("path", ["slot-table", "buffers"])
@pytest.mark.parametrize("backend,layout,kernel", CASES, ids=[f"{b}-{lay.name}-k{k}" for b, lay, k in CASES])
def test_a_save_reads_what_the_engine_wrote_and_a_load_lands_where_its_kernel_reads(backend, layout, kernel, path):
    submitted = []
    service = types.SimpleNamespace(submit_put=lambda model, hashes, states, **kw: submitted.append((states, kw))
                                    or True, put_fits=lambda chunks, nbytes: True)
    worker, views, layers = _worker(service, backend, layout, kernel, paged=path == "slot-table")
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

    def get_paged(model, hashes, into):
        assert into.caches.device == views[0].device and into.caches.dtype == views[0].dtype
        for i in range(len(hashes)):
            scatter_eager(*decoded[i], into.caches, into.slots(i, CHUNK))
        return len(hashes)

    worker.service = types.SimpleNamespace(get=get, get_paged=get_paged, observe=lambda *a: None)
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


def _real_service(tmp_path):
    store = TieredStore([CpuTier(1 << 20)], FileRegistry(tmp_path / "reg.json"), chunk_size=8)
    write_tiny_bundle(tmp_path / "bundle", consumers=("consumer-a",))
    service = KVService(store, [tmp_path / "bundle"])
    hashes = [bytes([i]) * 16 for i in range(3)]
    assert service.put(PRODUCER, hashes, chunked(3, 8, seed=5)) == 3
    return store, service, hashes


def _loaded(service, hashes, paged, share=None, backend="FLASH_ATTN", layout=KVCacheLayout.BLNHC, kernel=None):
    """The caches (as int16 bits) a worker leaves after loading the consumer's codes from token 3 on."""
    heads = share.count if share is not None else LAYOUT.kv_heads
    worker, views, _ = _worker(service, backend, layout, kernel, heads=heads, dim=LAYOUT.head_dim,
                               dtype=torch.float16, paged=paged, share=share)
    for view in views:
        view.fill_(float("nan"))
    worker.load(StepPlan(loads=[ChunkLoad("r", "consumer-a", hashes, 8, 3, [6, 2], BLOCK)]))
    assert worker.failed_blocks() == set()
    return worker, torch.stack(list(views)).view(torch.int16)


@pytest.mark.parametrize("backend,layout,kernel", CASES[1:3], ids=[f"{b}-{lay.name}-k{k}" for b, lay, k in CASES[1:3]])
def test_slot_table_and_buffer_loads_of_real_codes_leave_the_same_bytes(backend, layout, kernel, tmp_path):
    """A real consumer's codes (the tiny bundle's space and pair), loaded from token 3 on (the engine's own
    prefix cache holds 0..2): the slot-table load and the buffers-and-op load leave identical caches."""
    store, service, hashes = _real_service(tmp_path)
    caches = [_loaded(service, hashes, paged, backend=backend, layout=layout, kernel=kernel)[1]
              for paged in (True, False)]
    assert torch.equal(caches[0], caches[1])
    assert int((caches[0] != torch.tensor(float("nan"), dtype=torch.float16).view(torch.int16)).sum()) \
        == LAYERS * 21 * 2 * LAYOUT.kv_heads * LAYOUT.head_dim  # 21 tokens written, K and V
    store.close()



@pytest.mark.parametrize("paged", [True, False], ids=["slot-table", "buffers"])
def test_each_tensor_parallel_rank_loads_its_share_of_the_heads_and_stores_nothing(paged, tmp_path):
    """Two ranks (one KV head each of the tiny model's two) leave exactly their heads of what one rank holding
    both heads leaves; a rank holding a share refuses saves (a producer runs at tensor-parallel size 1)."""
    store, service, hashes = _real_service(tmp_path)
    _, whole = _loaded(service, hashes, paged)  # [layers, blocks, heads, block, 2 * dim]
    for rank in range(2):
        worker, share = _loaded(service, hashes, paged, HeadShare.of_rank(rank, 2, LAYOUT.kv_heads))
        assert torch.equal(share, whole[:, :, rank:rank + 1])
        submitted = []
        worker.service = types.SimpleNamespace(submit_put=lambda *a, _to=submitted, **kw: _to.append(a) or True,
                                               put_fits=lambda *a: True, observe=lambda *a: None)
        worker.save(StepPlan(saves=[ChunkSave("r", PRODUCER, [hashes[0]], [0], [list(range(8))])]))
        assert submitted == []
    with pytest.raises(Exception, match="share"):
        _worker(service, "FLASH_ATTN", KVCacheLayout.BLNHC, None, heads=2, dim=LAYOUT.head_dim,
                share=HeadShare.of_rank(0, 2, LAYOUT.kv_heads))  # caches of two heads for a one-head share
    store.close()
