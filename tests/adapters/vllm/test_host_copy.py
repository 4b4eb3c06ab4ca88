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


def test_the_save_copy_waits_for_the_forwards_writes_on_the_stream_it_queues_on(monkeypatch):
    """The hazard: the copy was queued on whichever stream was current at the save, and its event recorded on the
    current device's stream. Now the gather waits for the forward's write event first, and the copy's event is
    recorded on the stream the copies were queued on (played with stand-ins for CUDA's stream and tensors)."""
    from scd_store.adapters.vllm import host_copy

    calls: list[tuple] = []

    class Stream:
        def wait_event(self, event):
            calls.append(("wait", event))

    class Cache:
        device = torch.device("cuda", 1)

        def index_select(self, dim, part):
            calls.append(("gather", tuple(part.tolist())))
            return part

    stream = Stream()
    monkeypatch.setattr(host_copy.torch.cuda, "current_stream", lambda device=None: calls.append(
        ("stream of", device)) or stream)
    monkeypatch.setattr(host_copy, "to_host", lambda tensors, on=None: calls.append(("copy on", on)) or tensors)
    host_copy.copy_blocks([Cache(), Cache()], torch.tensor([4, 5, 9]), [2, 1], after="forward-wrote")
    assert calls[0] == ("stream of", torch.device("cuda", 1)) and calls[1] == ("wait", "forward-wrote")
    assert [c for c in calls if c[0] == "gather"] == [("gather", (4, 5))] * 2 + [("gather", (9,))] * 2
    assert calls[-1] == ("copy on", stream)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/device_check.sh runs it)")
def test_cuda_save_copy_reads_what_a_forward_on_another_stream_wrote():
    from scd_store.adapters.vllm.host_copy import copy_blocks, written_event

    cache = torch.zeros(8, 4, 16, 128, device="cuda")
    want = torch.randn(8, 4, 16, 128, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    forward = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(forward):  # the engine's forward, on a stream that is not the one current at the save
        for _ in range(8):
            big = big @ big
            big = big / big.norm()
        cache.copy_(want)
        wrote = written_event(cache.device)
    copy = copy_blocks([cache], torch.tensor([1, 6], device="cuda"), [2], after=wrote)
    copy.wait()
    assert torch.equal(copy.tensors[0], want[[1, 6]].cpu())
