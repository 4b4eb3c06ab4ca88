"""The producer's hand-off from the engine's device to scd-store's put worker: :func:`to_host`.

On a CUDA engine the engine's thread must not wait for a device-to-host copy: the gathered blocks
are copied into pinned host memory with non-blocking copies on the engine's current stream, and an
event recorded after them is what the put worker waits on (:meth:`HostCopy.wait`) before it reads
them. Pinned memory comes from PyTorch's caching host allocator, which reuses a block only once the
copies that used it are done. On the CPU the gathered blocks are already host copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class HostCopy:
    """Host tensors that hold their values once :meth:`wait` returns; ``nbytes``: the memory they hold."""

    tensors: list[torch.Tensor]
    event: Any = None  # a torch.cuda.Event recorded after the copies, or None (already complete)
    nbytes: int = 0

    def wait(self) -> None:
        """Block the calling thread (the put worker, never the engine's) until the copies are complete."""
        if self.event is not None:
            self.event.synchronize()


def to_host(tensors: list[torch.Tensor]) -> HostCopy:
    """Host copies of ``tensors`` without making the calling thread wait (see the module's docstring)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if not tensors or all(t.device.type == "cpu" for t in tensors):
        return HostCopy(list(tensors), None, nbytes)
    host = []
    for tensor in tensors:
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        pinned.copy_(tensor, non_blocking=True)
        host.append(pinned)
    event = torch.cuda.Event()
    event.record()  # on the current stream, after the copies
    return HostCopy(host, event, nbytes)
