import pytest
import torch

from scd_store.codecs.kv_state import KVState


def chunk(start: int, tokens: int = 4) -> KVState:
    return KVState(torch.randn(2, 3, tokens, 8), torch.randn(2, 3, tokens, 8), start=start)


def test_consecutive_chunks_join_into_one_state_from_the_first_start():
    parts = [chunk(8), chunk(12), chunk(16, tokens=2)]
    joined = KVState.cat(parts)
    assert joined.start == 8 and joined.num_tokens == 10
    assert torch.equal(joined.keys[:, :, 4:8], parts[1].keys) and torch.equal(joined.values[:, :, 8:], parts[2].values)


def test_only_consecutive_chunks_join():
    with pytest.raises(ValueError, match="consecutive"):
        KVState.cat([chunk(0), chunk(8)])
    with pytest.raises(ValueError, match="no states"):
        KVState.cat([])
