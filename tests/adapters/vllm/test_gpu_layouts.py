"""The connector's map, read and write on vLLM's CUDA backends' caches, bit for bit, on the CPU: every
``KVCacheLayout`` vLLM 0.32 can build, bf16 and fp16, kernel blocks split from manager blocks, driven
through the backends' own ``do_kv_cache_update`` (see :mod:`tests.adapters.vllm.gpu_layers`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.adapters.vllm.paged_layout import layer_maps, probe, read_tokens, write_tokens  # noqa: E402
from tests.adapters.vllm.gpu_layers import BACKENDS, LAYOUTS, engine_views, gpu_layer, patch_cache_ops  # noqa: E402

HEADS, DIM, BLOCK, BLOCKS, LAYERS = 2, 16, 32, 6, 3


@pytest.fixture(autouse=True)
def reference_op(monkeypatch):
    patch_cache_ops(monkeypatch)


def _splits(layout):
    yield None
    if layout.value[:2] == (0, 1):  # vLLM splits manager blocks into kernel blocks only where pages are dense
        yield BLOCK // 2


CASES = [(backend, layout, dtype, kernel) for backend in BACKENDS for layout in LAYOUTS
         for dtype in (torch.bfloat16, torch.float16) for kernel in _splits(layout)]


@pytest.mark.parametrize("backend,layout,dtype,kernel", CASES,
                         ids=[f"{b}-{lay.name}-{str(d)[6:]}-k{k}" for b, lay, d, k in CASES])
def test_what_the_engine_wrote_reads_back_exactly_through_its_strided_view(backend, layout, dtype, kernel):
    views = engine_views(layout, dtype, layers=LAYERS, blocks=BLOCKS, block_size=BLOCK, heads=HEADS,
                         head_dim=DIM, kernel_block_size=kernel)
    layer = gpu_layer(backend, HEADS, DIM)
    cache = views[1]
    assert not cache.is_contiguous() or layout.name == "LBHNC"  # the views the runner hands out are strided
    block_map = probe(layer, cache)
    tokens = BLOCK + 9
    keys, values = (torch.randn(tokens, HEADS, DIM).to(dtype) for _ in range(2))
    manager_blocks = [4, 1]  # a request's blocks lie anywhere in the pool, in any order
    slots = torch.tensor([manager_blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(tokens)])
    layer.impl.do_kv_cache_update(layer, keys, values, cache, slots)  # the engine's own write
    got_k, got_v = read_tokens(block_map, cache, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    assert all(bool((v == 0).all()) for i, v in enumerate(views) if i != 1)  # other layers' pages untouched


@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.name for lay in LAYOUTS])
def test_writes_land_where_the_engine_reads_and_nowhere_else(layout):
    views = engine_views(layout, torch.bfloat16, layers=LAYERS, blocks=BLOCKS, block_size=BLOCK, heads=HEADS,
                         head_dim=DIM)
    layer = gpu_layer("FLASH_ATTN", HEADS, DIM)
    cache = views[2]
    block_map = probe(layer, cache)
    keys, values = torch.randn(20, HEADS, DIM), torch.randn(20, HEADS, DIM)
    slots = torch.arange(2 * BLOCK + 3, 2 * BLOCK + 23)
    write_tokens(layer, cache, keys, values, slots)
    k_cache, v_cache = cache.transpose(1, 2).split(DIM, dim=-1)  # how the FlashAttention kernel reads it
    blocks, offsets = slots // BLOCK, slots % BLOCK
    assert torch.equal(k_cache[blocks, offsets], keys.to(torch.bfloat16))
    assert torch.equal(v_cache[blocks, offsets], values.to(torch.bfloat16))
    got_k, _ = read_tokens(block_map, cache, slots)
    assert torch.equal(got_k, keys.to(torch.bfloat16))
    written = torch.zeros(cache.shape[0], cache.shape[2], dtype=torch.bool)
    written[blocks, offsets] = True
    assert bool((cache.transpose(1, 2)[~written] == 0).all())
    assert all(bool((v == 0).all()) for i, v in enumerate(views) if i != 2)


def test_layers_of_one_layout_share_one_probed_map():
    views = engine_views(LAYOUTS[0], torch.float16, layers=LAYERS, blocks=BLOCKS, block_size=BLOCK, heads=HEADS,
                         head_dim=DIM)
    layer = gpu_layer("TRITON_ATTN", HEADS, DIM)
    maps = layer_maps([layer] * LAYERS, views)
    assert maps[0] is maps[1] is maps[2]
