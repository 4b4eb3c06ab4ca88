"""Where a consumer's pages are decoded (the ``decode_device`` setting): :class:`DeviceDecode` on the CPU in the
calling thread (the default), :class:`StreamDecode` on a CUDA device; :func:`device_decode` picks one at start.

SGLang calls a storage backend's reads from its prefetch threads (up to 128 pages a call) and gives the
backend only its pinned host pool. On CUDA each calling thread decodes on a stream of its own (created on its
first call; :mod:`scd_store.service.device_staging`), which first waits for the thread's current stream, into
one page of staging KV on the device (so a read holds one page there, whatever its length); stream order puts
each page's conversion to the pool's layout and dtype, and its copy to pinned host memory, before the next
page's decode overwrites the staging. The read synchronises that stream alone (failed or not) before it hands
the host pages back, so a page is written into the host pool only once it is complete. A device with no room
for the staging page ends the run there (a miss from that page on, logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from scd_store.adapters.sglang.pages import flat_page
from scd_store.codecs.kv_state import KVState
from scd_store.service.device_staging import (
    CallerStream,
    PrivateStreams,
    StagedRun,
    StreamFactory,
    StreamScope,
    cuda_stream,
    current_stream,
    on_stream,
)
from scd_store.service.devices import resolve_decode_device
from scd_store.service.log_once import LogOnce

Pair = tuple[torch.Tensor, torch.Tensor]
_once = LogOnce(logging.getLogger("scd_store.adapters.sglang"))


class DeviceDecode:
    """Decodes on the CPU in the calling thread, as the service returns the states."""

    device = torch.device("cpu")

    def read(self, service: Any, model: str, hashes: Sequence[bytes], pool: Any) -> list[torch.Tensor]:
        """``model``'s decodes of the leading run of ``hashes`` the service holds, as flat pages of ``pool`` (its
        layout and dtype) in host memory, complete when this returns."""
        return [flat_page(state, pool.layout, pool.dtype) for state in service.get(model, hashes)]


class StreamDecode(DeviceDecode):
    """Decodes on ``device``, page by page into staging KV, on a stream per calling thread; synchronises that
    stream before returning the host pages. ``new_stream`` / ``use_stream`` / ``caller_stream`` are CUDA's
    unless a test injects its own (:class:`~scd_store.service.device_staging.PrivateStreams`)."""

    def __init__(self, device: torch.device, new_stream: StreamFactory = cuda_stream,
                 use_stream: StreamScope = on_stream, caller_stream: CallerStream = current_stream) -> None:
        self.device = device
        self.streams = PrivateStreams(device, new_stream, use_stream, caller_stream)

    def stream(self) -> Any:
        """The calling thread's stream, created on its first call."""
        return self.streams.stream()

    def read(self, service: Any, model: str, hashes: Sequence[bytes], pool: Any) -> list[torch.Tensor]:
        host: list[torch.Tensor] = []
        shape = (2, pool.layer_num, pool.head_num, pool.page_size, pool.head_dim)  # float32 (keys, values)

        def page_out(staging: torch.Tensor) -> None:  # the staged page, converted, on its way to pinned host memory
            host.append(self.streams.to_host(flat_page(KVState(staging[0], staging[1]), pool.layout, pool.dtype)))

        # the thread's staging page is kept between its reads (ordered on its own stream)
        with StagedRun(self.streams, self.streams.buffer("page", _once)) as run:

            def into(i: int, tokens: int) -> Pair | None:
                if tokens != pool.page_size:  # not one of this pool's pages: the run ends here
                    return None
                staging = run.stage(shape, torch.float32, page_out)  # page i - 1 is out before page i's decode
                return None if staging is None else (staging[0], staging[1])

            run.land(len(service.get(model, hashes, into=into)))
        return host  # decodes and copies done (the run synchronised the stream): the pages may be written now


def device_decode(setting: str) -> DeviceDecode:
    """The decoder for ``decode_device`` (:func:`~scd_store.service.devices.resolve_decode_device`). ``cuda``
    without an index is the start thread's current device: SGLang's prefetch threads never set theirs."""
    device = resolve_decode_device(setting)
    return DeviceDecode() if device.type == "cpu" else StreamDecode(device)
