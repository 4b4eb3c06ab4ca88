"""Staged device decodes for engine adapters: a consumer's KV decodes on a CUDA device into a staging tensor, is
copied to (pinned) host memory without blocking, and is waited for before the host memory goes to the engine.

:class:`PrivateStreams` gives each calling thread a stream of its own on the device (made on its first use).
A run enters that stream once it has waited for the caller's current stream (what the caller queued there
before the run, its inputs, is visible to the decode), queues its decodes and copies there, and its wait
synchronises that private stream only: never the caller's, which inside an engine's worker is the engine's own
stream, its model kernels queued after the run began not waited for.

:class:`StagedRun` is one get through such streams: one staging tensor (:class:`StagingBuffer`, per run or kept
per thread) reused item after item (``KVService.get`` asks for item ``i``'s buffers once ``i - 1`` is decoded,
so ``i - 1``'s copy is queued then, and stream order puts it before ``i``'s decode); a device with no room for
the staging ends the run there (a miss from there on, logged once); the wait always runs when the run closes,
failed or not, so no host memory is handed back (or freed) with a copy in flight.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Protocol

import torch

from scd_store.service.log_once import LogOnce

log = logging.getLogger("scd_store.service")
_once = LogOnce(log)

StreamFactory = Callable[[torch.device], Any]  # a new stream on the device
StreamScope = Callable[[Any], contextlib.AbstractContextManager[Any]]  # makes a stream (and its device) current
CallerStream = Callable[[torch.device], Any]  # the calling thread's current stream on the device, or None


def cuda_stream(device: torch.device) -> Any:
    """A new CUDA stream on ``device``."""
    return torch.cuda.Stream(device)


def on_stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """``stream`` current in the calling thread (its device too) while the context is open."""
    return torch.cuda.stream(stream)


def current_stream(device: torch.device) -> Any:
    """The calling thread's current stream on ``device`` (inside an engine's worker, the engine's own); None off
    CUDA (a CPU device standing for one in tests has none)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


class Copies(Protocol):
    """How a staged run reaches host memory: the scope its decodes run in, queued copies, a wait for them."""

    def scope(self) -> contextlib.AbstractContextManager[Any]: ...

    def copy(self, host: torch.Tensor, staging: torch.Tensor) -> None: ...

    def wait(self) -> None: ...


class StagingBuffer:
    """One staging tensor on ``device``, reused while the shape and dtype asked for are its own. ``what`` names
    an item (``chunk``, ``page``) in the line ``once`` logs (the adapter's logger) when the device has no room."""

    def __init__(self, device: torch.device, what: str = "chunk", once: LogOnce | None = None) -> None:
        self.device, self.what = device, what
        self.once = once if once is not None else _once
        self.tensor: torch.Tensor | None = None

    def get(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """The staging tensor of ``shape`` and ``dtype``, or None when the device has no room for it (logged
        once): the run ends there. A tensor of another shape is dropped first (stream order keeps the work
        already queued on it safe: its memory is reused by later work of the same stream only)."""
        tensor = self.tensor
        if tensor is None or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            self.tensor = None
            try:
                tensor = self.tensor = torch.empty(tuple(shape), dtype=dtype, device=self.device)
            except torch.OutOfMemoryError:
                self.once.warn(f"oom:{self.device}:{self.what}", "scd-store: decode_device %s has no room for "
                               "a %s's KV; the %ss from there on miss (logged once)", self.device, self.what,
                               self.what)
                return None
        return tensor


class PrivateStreams:
    """The calling thread's own stream on ``device`` (:class:`Copies` for a :class:`StagedRun`).

    :meth:`scope` makes it wait for the caller's current stream, then current; copies are queued on it;
    :meth:`wait` synchronises it alone. ``new_stream``, ``use_stream`` and ``caller_stream`` are CUDA's unless a
    test injects its own."""

    def __init__(self, device: torch.device, new_stream: StreamFactory = cuda_stream,
                 use_stream: StreamScope = on_stream, caller_stream: CallerStream = current_stream) -> None:
        self.device = device
        self._new_stream, self._use_stream, self._caller_stream = new_stream, use_stream, caller_stream
        self._local = threading.local()

    def stream(self) -> Any:
        """The calling thread's stream, made on its first call."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = self._new_stream(self.device)
        return stream

    def buffer(self, what: str = "chunk", once: LogOnce | None = None) -> StagingBuffer:
        """The calling thread's staging buffer (made on its first call with ``what`` and ``once``, as
        :class:`StagingBuffer`'s), kept between its runs: they are ordered on its own stream."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = StagingBuffer(self.device, what, once)
        return buffer

    @contextlib.contextmanager
    def scope(self) -> Iterator[Any]:
        """The thread's stream, after the caller's current stream (its queued work first), current while open."""
        stream, caller = self.stream(), self._caller_stream(self.device)
        if caller is not None:
            stream.wait_stream(caller)
        with self._use_stream(stream):
            yield stream

    def copy(self, host: torch.Tensor, staging: torch.Tensor) -> None:
        """Queue ``staging``'s copy into ``host`` on the current (the thread's) stream, without blocking."""
        host.copy_(staging, non_blocking=True)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` copied to new host memory (pinned, from CUDA), queued without blocking."""
        return tensor.to("cpu", non_blocking=True)

    def wait(self) -> None:
        """Synchronise the calling thread's stream: its decodes and copies are done (the caller's is not waited
        for beyond what it had queued when the run began)."""
        self.stream().synchronize()


class StagedRun:
    """One get staged through ``copies`` into ``buffer`` (a fresh :class:`StagingBuffer` per run, or the thread's
    :meth:`PrivateStreams.buffer`): a context manager of the calling thread, whose close waits for every queued
    copy, failed or not."""

    def __init__(self, copies: Copies, buffer: StagingBuffer) -> None:
        self.copies, self.buffer = copies, buffer
        self._pending: Callable[[], None] | None = None  # the last handed item's way out, once it is decoded
        self._handed = 0  # items whose staging was handed out
        self._scope: contextlib.ExitStack | None = None

    def __enter__(self) -> StagedRun:
        scope = contextlib.ExitStack()
        scope.enter_context(self.copies.scope())
        self._scope = scope
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._pending = None  # never decoded (or the get failed): not copied
        scope, self._scope = self._scope, None
        try:
            if scope is not None:
                scope.close()
        finally:
            self.copies.wait()  # every queued copy lands before the engine reads or frees its host memory

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending()

    def stage(self, shape: Sequence[int], dtype: torch.dtype,
              out: Callable[[torch.Tensor], None]) -> torch.Tensor | None:
        """The staging tensor for the next item, or None (no room on the device: the run ends here). The previous
        item is decoded by now: its ``out`` is queued first. ``out(staging)`` queues this item's way to host
        memory; it runs once the item is known decoded (at the next :meth:`stage`, or :meth:`land`)."""
        self._flush()
        staging = self.buffer.get(shape, dtype)
        if staging is None:
            return None
        self._pending = lambda: out(staging)
        self._handed += 1
        return staging

    def stage_into(self, host: torch.Tensor) -> torch.Tensor | None:
        """:meth:`stage` for an item landing in ``host``: staging of its shape and dtype, copied into it."""
        return self.stage(host.shape, host.dtype, lambda staging: self.copies.copy(host, staging))

    def land(self, decoded: int) -> None:
        """The get decoded its first ``decoded`` items: the last one's ``out`` is queued if it is among them (the
        wait comes when the run closes)."""
        if self._handed <= decoded:
            self._flush()
        self._pending = None


__all__ = ["Copies", "PrivateStreams", "StagedRun", "StagingBuffer", "cuda_stream", "current_stream", "on_stream"]
