"""The paged decode's PyTorch side (codecs/scd/paged_fused.py), in this process and without Triton's
interpreter: the eager scatter lands each token where vLLM's CUDA backends read it (``[K | V]`` on the
last axis of the ``[blocks, heads, block_size, 2 * head_dim]`` view), the entry point falls back to it
where no kernel runs, slot tables follow vLLM's slot mapping, and every mismatch is refused before
anything is written."""

from __future__ import annotations

import pytest
import torch

from scd_store.codecs.scd import paged_fused as pf
from scd_store.codecs.scd.codec import ScdCodec
from tests.codecs.test_paged_fused import (
    BLOCK,
    BLOCKS,
    DIM,
    HEADS,
    LAYERS,
    LAYOUTS,
    buffers,
    slots_of,
    space_and_decoder,
    state,
)


def test_slot_table_is_vllms_slot_mapping():
    slots = pf.slot_table([4, 1, 3], 14, 20, BLOCK)
    want = [4 * BLOCK + 14, 4 * BLOCK + 15] + [BLOCK + p for p in range(16)] + [3 * BLOCK, 3 * BLOCK + 1]
    assert slots.tolist() == want and slots.dtype == torch.int64
    with pytest.raises(ValueError):
        pf.slot_table([4, 1], 14, 20, BLOCK)  # 34 places for two blocks
    with pytest.raises(ValueError):
        pf.slot_table([4, 1, 3], BLOCK, 3, BLOCK)


def test_the_eager_scatter_writes_where_the_cuda_backends_read():
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(LAYERS, HEADS, 40, DIM, generator=g), torch.randn(LAYERS, HEADS, 40, DIM, generator=g)
    raw = buffers("block-first", torch.bfloat16, "cpu")
    before = raw[0].clone()
    views = LAYOUTS["block-first"][1](raw)  # vLLM's per-layer [blocks, heads, block_size, 2 * head_dim] views
    slots = slots_of(40, 5, [4, 1, 3], "cpu")
    pf.scatter_eager(keys, values, pf.paged_caches(views), slots)
    written = torch.zeros(BLOCKS, LAYERS + 1, BLOCK, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if not 0 <= slot < BLOCKS * BLOCK:
            continue
        block, place = divmod(slot, BLOCK)
        for layer, view in enumerate(views):
            # FlashAttention's do_kv_cache_update: cache.transpose(1, 2).split(head_dim, -1)
            k_cache, v_cache = view.transpose(1, 2).split(DIM, dim=-1)
            assert torch.equal(k_cache[block, place], keys[layer, :, t].to(torch.bfloat16))
            assert torch.equal(v_cache[block, place], values[layer, :, t].to(torch.bfloat16))
            written[block, layer, place] = True
    assert int(written.sum()) == LAYERS * 36
    assert torch.equal(raw[0][~written], before[~written])  # other blocks, places and the undecoded layer


@pytest.mark.parametrize("start", [0, 37])
def test_without_a_kernel_the_entry_point_decodes_eagerly_into_the_slots(start):
    space, decoder = space_and_decoder()
    codec = ScdCodec(space, decoder, cuda_graphs=False, matmul="float32")
    tokens = 40
    codes = space.unpack(codec.encode(state(tokens, start, seed=start)), "cpu")
    raw = buffers("HND", torch.float32, "cpu")
    caches, slots = pf.paged_caches(LAYOUTS["HND"][1](raw)), slots_of(tokens, 5, [4, 1, 3], "cpu")
    assert not pf.decode_paged(codec, codes, caches, slots, kernel=False)
    want = codec.decode_codes(codes, "cpu", torch.float32)
    for t, slot in enumerate(slots.tolist()):
        if 0 <= slot < BLOCKS * BLOCK:
            for layer, view in enumerate(caches.layers):
                assert torch.equal(view[slot // BLOCK, 0, slot % BLOCK], want.keys[layer, :, t])
                assert torch.equal(view[slot // BLOCK, 1, slot % BLOCK], want.values[layer, :, t])


def test_paged_caches_reads_one_allocation_and_separate_tensors():
    raw = buffers("block-first", torch.float16, "cpu")
    caches = pf.paged_caches(LAYOUTS["block-first"][1](raw))
    layer = BLOCK * HEADS * 2 * DIM  # one layer's page within a block
    assert caches.offsets.tolist() == [0, layer] and caches.base.data_ptr() == raw[0].data_ptr()
    assert caches.strides == ((LAYERS + 1) * layer, DIM, HEADS * 2 * DIM, 2 * DIM, 1)
    assert (caches.num_blocks, caches.block_size, caches.heads, caches.head_dim) == (BLOCKS, BLOCK, HEADS, DIM)
    separate = buffers("separate", torch.float16, "cpu")[::-1][:LAYERS]  # the lowest address need not be layer 0
    caches = pf.paged_caches(separate)
    low = min(t.data_ptr() for t in separate)
    assert caches.base.data_ptr() == low
    assert caches.offsets.tolist() == [(t.data_ptr() - low) // 2 for t in separate]


def test_mismatched_caches_are_refused():
    raw = buffers("HND", torch.float32, "cpu")[0]
    with pytest.raises(ValueError):
        pf.paged_caches([])
    with pytest.raises(ValueError):
        pf.paged_caches([raw[0], raw[1].transpose(1, 2).contiguous().transpose(1, 2)])  # other strides
    with pytest.raises(ValueError):
        pf.paged_caches([raw[0], raw[1, :, :1]])  # other shape
    with pytest.raises(ValueError):
        pf.paged_caches([raw[0].to(torch.int8)])
    with pytest.raises(ValueError):
        pf.paged_caches([torch.zeros(BLOCKS, 3, BLOCK, HEADS, DIM)])  # not K / V on axis 1
    with pytest.raises(ValueError):
        pf.paged_caches([torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM + 1)])


def test_mismatched_decodes_are_refused_before_anything_is_written():
    space, decoder = space_and_decoder()
    codec = ScdCodec(space, decoder, cuda_graphs=False, matmul="float32")
    codes = space.unpack(codec.encode(state(40, 0, seed=0)), "cpu")
    raw = buffers("NHD", torch.bfloat16, "cpu")
    before = raw[0].clone()
    views = LAYOUTS["NHD"][1](raw)
    caches, slots = pf.paged_caches(views), slots_of(40, 5, [4, 1, 3], "cpu")
    coded = 40 - codes.sinks.num_tokens
    bad = [(pf.paged_caches(views[:1]), slots, None),  # one layer short
           (pf.paged_caches([v[:, :1] for v in views]), slots, None),  # one head short
           (caches, slots[:-1], None), (caches, slots.int(), None), (caches, slots[None], None),
           (caches, slots, (torch.zeros(coded, DIM), torch.zeros(coded, DIM))),  # full-width angles
           (caches, slots, (torch.zeros(coded - 1, DIM // 2),) * 2)]
    for target, table, angles in bad:
        for kernel in (True, False):
            with pytest.raises(ValueError):
                pf.decode_paged(codec, codes, target, table, angles, kernel=kernel)
    with pytest.raises(ValueError):
        pf.decode_paged(ScdCodec(space), codes, caches, slots)  # an encoder only
    assert torch.equal(raw[0], before)


def test_the_launchers_check_their_operands_before_launching():
    caches = pf.paged_caches(LAYOUTS["HND"][1](buffers("HND", torch.float16, "cpu")))
    target = (caches.base, caches.offsets, caches.strides, BLOCK, BLOCKS)
    tokens, active, groups = 8, 32, 2 * LAYERS
    operands = dict(sorted_codes=torch.zeros(70, tokens, dtype=torch.uint8),
                    rows=torch.zeros(groups, active, dtype=torch.int64),
                    matrix=torch.zeros(groups, active, HEADS * DIM, dtype=torch.float16),
                    offset=torch.zeros(groups, HEADS * DIM), cos=torch.zeros(tokens, DIM // 2),
                    sin=torch.zeros(tokens, DIM // 2))
    slots = torch.arange(tokens)
    for name, wrong in (("rows", torch.zeros(groups + 2, active, dtype=torch.int64)),
                        ("matrix", torch.zeros(groups, active, HEADS * DIM + 1, dtype=torch.float16)),
                        ("offset", torch.zeros(groups, 1)), ("sin", torch.zeros(tokens + 1, DIM // 2)),
                        ("sorted_codes", torch.zeros(tokens, 70, dtype=torch.uint8).t())):
        with pytest.raises(ValueError):
            pf.paged_decode(**{**operands, name: wrong}, cache=target[0], layer_offsets=target[1],
                            strides=target[2], block_size=BLOCK, num_blocks=BLOCKS, slots=slots)
    with pytest.raises(ValueError):
        pf.paged_decode(*operands.values(), *target, slots[:-1])
    with pytest.raises(ValueError):
        pf.paged_decode(*operands.values(), caches.base, caches.offsets.int(), *target[2:], slots)
    keys = torch.zeros(LAYERS, HEADS, tokens, DIM)
    with pytest.raises(ValueError):
        pf.paged_scatter(keys, keys[:, :1], *target, slots)
    with pytest.raises(ValueError):
        pf.paged_scatter(keys[:1], keys[:1], *target, slots)
    with pytest.raises(ValueError):
        pf.paged_scatter(keys, keys, *target[:2], target[2][:4], BLOCK, BLOCKS, slots)
