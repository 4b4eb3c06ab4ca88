"""A tensor-parallel rank's share of the KV heads: vLLM's sharding rule, and a share's decode is the
matching heads of the whole decode (buffers and paged caches alike), bit for bit."""

from __future__ import annotations

import pytest
import torch

from scd_store.codecs.head_share import HeadShare
from scd_store.codecs.paged import paged_caches
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.tensor_pack import PayloadError
from tests.codecs.test_scd_fused import LAYOUT64 as LAYOUT
from tests.codecs.test_scd_fused import space_and_decoder, state


def test_ranks_split_the_heads_or_replicate_them_as_vllm_does():
    assert [HeadShare.of_rank(r, 2, 8) for r in range(2)] == [HeadShare(0, 4, 8), HeadShare(4, 4, 8)]
    assert [HeadShare.of_rank(r, 8, 2).first for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert HeadShare.of_rank(0, 1, 3).is_whole and HeadShare.of_rank(0, 1, 3) == HeadShare(0, 3, 3)
    for bad in ((0, 3, 8), (0, 6, 4), (2, 2, 4), (-1, 2, 4)):
        with pytest.raises(ValueError):
            HeadShare.of_rank(*bad)
    for bad in ((0, 0, 2), (1, 2, 2), (-1, 1, 2)):
        with pytest.raises(ValueError):
            HeadShare(*bad)


def test_a_share_selects_its_heads_of_whole_head_kv_and_refuses_other_kv():
    kv = torch.arange(2 * 4 * 3 * 2).view(2, 4, 3, 2)
    assert torch.equal(HeadShare(1, 2, 4).select(kv), kv[:, 1:3])
    with pytest.raises(ValueError):
        HeadShare(0, 1, 2).select(kv)  # KV of 4 heads, a share of 2


@pytest.fixture(scope="module")
def codec():
    return ScdCodec(*space_and_decoder(), cuda_graphs=False, matmul="float32")


@pytest.mark.parametrize("rank", [0, 1])
def test_each_ranks_buffers_get_its_heads_of_the_whole_decode(codec, rank):
    payload = codec.encode(state(8, 8, seed=3))
    whole = codec.decode(payload)
    share = HeadShare.of_rank(rank, 2, LAYOUT.kv_heads)
    keys = torch.empty(LAYOUT.num_layers, 1, 8, LAYOUT.head_dim)
    values = torch.empty_like(keys)
    codec.decode_into(payload, keys, values, heads=share)
    assert torch.equal(keys, whole.keys[:, rank:rank + 1]) and torch.equal(values, whole.values[:, rank:rank + 1])
    with pytest.raises(ValueError):  # buffers of the whole heads cannot take a share
        codec.decode_into(payload, torch.empty_like(whole.keys), torch.empty_like(whole.values), heads=share)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_ranks_paged_cache_gets_its_heads_at_its_slots(codec, rank):
    payload = codec.encode(state(8, 8, seed=3))
    whole = codec.decode(payload)
    raw = [torch.full((4, 2, 4, 1, LAYOUT.head_dim), float("nan")) for _ in range(LAYOUT.num_layers)]
    slots = torch.tensor([9, 8, 3, 2, 1, 0, -1, 15], dtype=torch.int64)
    assert codec.decode_paged(payload, paged_caches(raw), slots, heads=HeadShare.of_rank(rank, 2, 2)) == 8
    keep = slots >= 0
    for layer, cache in enumerate(raw):
        got = cache[:, 0][slots[keep] // 4, slots[keep] % 4]  # [tokens, 1, dim]
        assert torch.equal(got, whole.keys[layer, rank:rank + 1, keep].transpose(0, 1))
    assert sum(int((~c.isnan()).sum()) for c in raw) == LAYOUT.num_layers * 2 * 7 * LAYOUT.head_dim


def test_a_share_of_another_models_heads_is_refused(codec):
    payload = codec.encode(state(8, 8, seed=3))
    keys = torch.empty(LAYOUT.num_layers, 1, 8, LAYOUT.head_dim)
    with pytest.raises(ValueError):
        codec.decode_into(payload, keys, torch.empty_like(keys), heads=HeadShare(0, 1, 4))  # a 4-head model's
    with pytest.raises(PayloadError):  # and the token count is still checked first
        codec.decode_into(payload, keys[:, :, :4], torch.empty_like(keys[:, :, :4]), heads=HeadShare(0, 1, 2))
