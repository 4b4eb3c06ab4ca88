import pytest
import torch

from scd_store.store.tiers.base import TierError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs CUDA")


@cuda
def test_gpu_tier_round_trip_and_byte_bound():
    from scd_store.store.tiers.gpu import GpuTier

    tier = GpuTier(max_bytes=3000)
    tier.put_now("a", b"x" * 1000)
    tier.put_now("b", bytes(range(256)) * 4)
    assert tier.get_tensor("a").device.type == "cuda"
    assert tier.get_now("b") == bytes(range(256)) * 4  # now "a" is the least recently used
    tier.put_now("c", b"z" * 1500)  # evicts the least recently used ("a")
    assert tier.contains_many_now(["a", "b", "c"]) == [False, True, True]
    assert tier.usage().bytes_used <= 3000


def test_gpu_tier_refuses_to_start_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    from scd_store.store.tiers.gpu import GpuTier

    with pytest.raises(TierError, match="CUDA"):
        GpuTier(max_bytes=1024)
