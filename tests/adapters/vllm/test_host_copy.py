"""The producer's device-to-host hand-off: the engine's thread starts the copy, the put worker waits."""

from __future__ import annotations

import pytest
import torch

from scd_store.adapters.vllm.host_copy import to_host


def test_cpu_blocks_are_handed_over_as_they_are():
    blocks = [torch.randn(2, 3, 4), torch.randn(5).bfloat16()]
    copy = to_host(blocks)
    copy.wait()
    assert copy.event is None and all(a is b for a, b in zip(copy.tensors, blocks, strict=True))
    assert copy.nbytes == 24 * 4 + 5 * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/device_check.sh runs it)")
def test_cuda_blocks_reach_pinned_memory_under_a_competing_kernel_without_the_caller_waiting():
    big = torch.randn(4096, 4096, device="cuda")
    blocks = [torch.randn(64, 8, 32, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    want = [b.cpu() for b in blocks]
    torch.cuda.synchronize()
    for _ in range(8):
        big = big @ big  # a kernel the copies queue behind on the engine's stream
        big = big / big.norm()
    copy = to_host(blocks)
    assert copy.event is not None and all(t.is_pinned() for t in copy.tensors)
    copy.wait()
    assert all(torch.equal(a, b) for a, b in zip(copy.tensors, want, strict=True))
