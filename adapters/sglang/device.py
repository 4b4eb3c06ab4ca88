"""Where a consumer's pages are decoded (the ``decode_device`` setting): :class:`DeviceDecode` on the CPU in the
calling thread (the default), :class:`StreamDecode` on a CUDA device; :func:`device_decode` picks one at start.

SGLang calls a storage backend's reads from its prefetch threads (up to 128 pages a call) and gives the
backend only its pinned host pool. On CUDA each calling thread decodes on a stream of its own (created on its
first call) into one page of staging KV on the device (so a read holds one page there, whatever its
length); stream order puts each page's conversion to the pool's layout and dtype, and its copy to pinned host
memory, before the next page's decode overwrites the staging. The read waits for the stream before it hands
the host pages back, so a page is written into the host pool only once it is complete.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from scd_store.adapters.sglang.pages import flat_page
from scd_store.codecs.kv_state import KVState
from scd_store.service.devices import resolve_decode_device

Pair = tuple[torch.Tensor, torch.Tensor]


class DeviceDecode:
    """Decodes on the CPU in the calling thread, as the service returns the states."""

    device = torch.device("cpu")

    def read(self, service: Any, model: str, hashes: Sequence[bytes], pool: Any) -> list[torch.Tensor]:
        """``model``'s decodes of the leading run of ``hashes`` the service holds, as flat pages of ``pool`` (its
        layout and dtype) in host memory, complete when this returns."""
        return [flat_page(state, pool.layout, pool.dtype) for state in service.get(model, hashes)]


def _cuda_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device)


def _on_stream(stream: Any) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream)  # also makes the stream's device current


class StreamDecode(DeviceDecode):
    """Decodes on ``device``, page by page into staging KV, on a stream per calling thread; synchronises the
    stream before returning the host pages. ``new_stream`` / ``use_stream`` are CUDA's unless a test injects
    its own."""

    def __init__(self, device: torch.device, new_stream: Callable[[torch.device], Any] = _cuda_stream,
                 use_stream: Callable[[Any], contextlib.AbstractContextManager] = _on_stream) -> None:
        self.device = device
        self._new_stream = new_stream
        self._use_stream = use_stream
        self._local = threading.local()

    def stream(self) -> Any:
        """The calling thread's stream, created on its first call."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = self._new_stream(self.device)
        return stream

    def _staging(self, shape: tuple[int, int, int, int]) -> Pair:
        """The calling thread's float32 ``(keys, values)`` of one page on the device (reused: its reads are
        ordered on its own stream)."""
        staging = getattr(self._local, "staging", None)
        if staging is None or tuple(staging[0].shape) != shape:
            staging = self._local.staging = (torch.empty(shape, device=self.device),
                                             torch.empty(shape, device=self.device))
        return staging

    def read(self, service: Any, model: str, hashes: Sequence[bytes], pool: Any) -> list[torch.Tensor]:
        stream, host = self.stream(), []
        with self._use_stream(stream):
            staging = self._staging((pool.layer_num, pool.head_num, pool.page_size, pool.head_dim))

            def page_out() -> None:  # the staged page, converted and on its way to pinned host memory
                host.append(flat_page(KVState(*staging), pool.layout, pool.dtype).to("cpu", non_blocking=True))

            def into(i: int, tokens: int) -> Pair | None:
                if tokens != pool.page_size:  # not one of this pool's pages: the run ends here
                    return None
                if i:
                    page_out()  # page i - 1 is decoded; page i overwrites the staging after it
                return staging

            decoded = len(service.get(model, hashes, into=into))
            if len(host) < decoded:
                page_out()
        stream.synchronize()  # decodes and copies done: the pages may be written now
        return host[:decoded]


def device_decode(setting: str) -> DeviceDecode:
    """The decoder for ``decode_device`` (:func:`~scd_store.service.devices.resolve_decode_device`). ``cuda``
    without an index is the start thread's current device: SGLang's prefetch threads never set theirs."""
    device = resolve_decode_device(setting)
    return DeviceDecode() if device.type == "cpu" else StreamDecode(device)
