"""The producer's hand-off from the engine's device to scd-store's put worker: :func:`copy_blocks`.

On a CUDA engine the engine's thread must not wait for a device-to-host copy: the chunks' blocks are
gathered and copied into pinned host memory with non-blocking copies on the cache device's current
stream, ordered after the event the engine's forward recorded when it wrote them (:func:`written_event`,
from ``save_kv_layer``: whichever stream is current when the save runs, the gather never reads blocks
before they hold the step's KV), and an event recorded after the copies on that same stream is what the
put worker waits on (:meth:`HostCopy.wait`) before it reads them. Pinned memory comes from PyTorch's
caching host allocator, which reuses a block only once the copies that used it are done. On the CPU the
gathered blocks are already host copies.
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


def written_event(device: torch.device) -> Any:
    """An event on ``device``'s current stream now (the engine's forward, as it writes the KV); None off CUDA."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def copy_blocks(caches: list[torch.Tensor], index: torch.Tensor, parts: list[int], after: Any = None) -> HostCopy:
    """Every layer's blocks ``index`` (on the caches' device), chunk by chunk (``parts``: blocks per chunk),
    gathered (``index_select``) and copied to host memory, after the event ``after`` on a GPU (the module's
    docstring): the tensors of chunk ``i`` are ``[i * layers, (i + 1) * layers)``."""
    device = caches[0].device
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    if stream is not None and after is not None:
        stream.wait_event(after)
    gathered: list[torch.Tensor] = []
    offset = 0
    for count in parts:
        part = index[offset:offset + count]
        offset += count
        gathered.extend(cache.index_select(0, part) for cache in caches)
    return to_host(gathered, stream)


def to_host(tensors: list[torch.Tensor], stream: Any = None) -> HostCopy:
    """Host copies of ``tensors`` without making the calling thread wait, the event recorded on ``stream`` (default:
    the current stream of the tensors' device, which the copies were queued on)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if not tensors or all(t.device.type == "cpu" for t in tensors):
        return HostCopy(list(tensors), None, nbytes)
    host = []
    for tensor in tensors:
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        pinned.copy_(tensor, non_blocking=True)
        host.append(pinned)
    event = torch.cuda.Event()
    event.record(stream if stream is not None else torch.cuda.current_stream(tensors[0].device))
    return HostCopy(host, event, nbytes)
