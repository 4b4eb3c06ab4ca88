"""Where a consumer's codes are decoded before LMCache reads them (the ``decode_device`` setting):
:func:`decode_target`.

LMCache hands the plugin (and the L2 adapter) host memory objects (``KV_2LTD``, pinned where CUDA
is present). ``decode_device: cpu`` decodes straight into them (:class:`HostDecode`, no copy).
``cuda`` / ``cuda:N`` (:class:`DeviceDecode`) decodes each chunk into a staging tensor on the device
and copies it into its memory object without blocking, on the stream the decode ran on (so the copy
follows the decode); the batch waits for every copy to land before it returns, failed or not, so
LMCache never reads (or frees) a memory object with a copy still in flight. One staging tensor is
reused through a batch (``KVService.get`` asks for chunk ``i``'s buffers once chunk ``i - 1`` is
decoded; stream order puts the copy of ``i - 1`` before the decode of ``i``): a batch holds one
chunk's KV on the device, whatever its length. A device with no room for it ends the run there (a
miss from that chunk on, logged once), as a full LMCache allocator does.
"""

from __future__ import annotations

import contextlib
import logging
from types import ModuleType, TracebackType
from typing import Any, Protocol

import torch

from scd_store.adapters.lmcache.layout import kv_2ltd_views
from scd_store.service.devices import resolve_decode_device
from scd_store.service.log_once import LogOnce

Pair = tuple[torch.Tensor, torch.Tensor]
log = logging.getLogger("scd_store.adapters.lmcache")
_once = LogOnce(log)


decode_device = resolve_decode_device  # the device ``decode_device`` names, checked at start


class Copies(Protocol):
    """How staged chunks reach host memory: queued copies, a wait for them, and the device's scope."""

    def copy(self, host: torch.Tensor, staging: torch.Tensor) -> None: ...

    def wait(self) -> None: ...

    def scope(self) -> contextlib.AbstractContextManager[Any]: ...


class CudaCopies:
    """Copies on the device's current stream (where the decode runs), without blocking; :meth:`wait`
    synchronises that stream."""

    def __init__(self, device: torch.device, cuda: ModuleType = torch.cuda) -> None:
        self.device, self.cuda = device, cuda

    def copy(self, host: torch.Tensor, staging: torch.Tensor) -> None:
        host.copy_(staging, non_blocking=True)

    def wait(self) -> None:
        self.cuda.current_stream(self.device).synchronize()

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        return self.cuda.device(self.device)  # the get's own tensors and streams on the decode device


class HostBatch:
    """One get's chunks decoded straight into their host tensors."""

    def __init__(self, heads: int) -> None:
        self.heads = heads

    def __enter__(self) -> HostBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def buffers(self, host: torch.Tensor) -> Pair | None:
        """The decode's ``(keys, values)`` buffers for a chunk landing in ``host`` (``[2, L, T, H*D]``); None
        ends the run there."""
        return kv_2ltd_views(host, self.heads)

    def land(self, decoded: int) -> None:
        """The get decoded its first ``decoded`` chunks: nothing left to move."""


class StagedBatch(HostBatch):
    """One get's chunks decoded into a device staging tensor, each copied into its host tensor."""

    def __init__(self, heads: int, device: torch.device, copies: Copies) -> None:
        super().__init__(heads)
        self.device, self.copies = device, copies
        self._staging: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (host, staging) of the last chunk
        self._handed = 0  # chunks whose buffers were handed out
        self._scope: contextlib.ExitStack | None = None

    def __enter__(self) -> StagedBatch:
        self._scope = contextlib.ExitStack()
        self._scope.enter_context(self.copies.scope())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._pending = None  # never decoded (or the get failed): not copied
        try:
            self.copies.wait()  # every queued copy lands before LMCache reads or frees a host tensor
        finally:
            if self._scope is not None:
                self._scope.close()

    def _flush(self) -> None:
        if self._pending is not None:
            self.copies.copy(*self._pending)
            self._pending = None

    def buffers(self, host: torch.Tensor) -> Pair | None:
        self._flush()  # the previous chunk is decoded: its copy is queued before this chunk's decode
        staging = self._staging
        if staging is None or staging.shape != host.shape or staging.dtype != host.dtype:
            try:
                staging = self._staging = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            except torch.OutOfMemoryError:
                _once.warn("oom", "scd-store: decode_device %s has no room for a chunk's KV; the chunks from "
                           "there on miss (logged once)", self.device)
                return None
        self._pending = (host, staging)
        self._handed += 1
        return kv_2ltd_views(staging, self.heads)

    def land(self, decoded: int) -> None:
        """Queue the last chunk's copy when it decoded (the wait comes when the batch closes)."""
        if self._handed <= decoded:
            self._flush()
        self._pending = None


class HostDecode:
    """``decode_device: cpu``: decode straight into LMCache's host memory objects."""

    device = torch.device("cpu")

    def batch(self, heads: int) -> HostBatch:
        return HostBatch(heads)


class DeviceDecode:
    """``decode_device: cuda[:N]``: decode on the device, copy into the host memory objects."""

    def __init__(self, device: torch.device, copies: Copies | None = None) -> None:
        self.device = device
        self.copies = copies if copies is not None else CudaCopies(device)

    def batch(self, heads: int) -> StagedBatch:
        return StagedBatch(heads, self.device, self.copies)


def decode_target(setting: str, cuda: Any = torch.cuda) -> HostDecode | DeviceDecode:
    """What ``decode_device`` says, checked now (a :class:`SettingsError` names it when it cannot be met)."""
    device = decode_device(setting, cuda)
    return HostDecode() if device.type == "cpu" else DeviceDecode(device)
