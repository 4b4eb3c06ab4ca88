"""Where a consumer's codes are decoded before LMCache reads them (the ``decode_device`` setting):
:func:`decode_target`.

LMCache hands the plugin (and the L2 adapter) host memory objects (``KV_2LTD``, pinned where CUDA
is present). ``decode_device: cpu`` decodes straight into them (:class:`HostDecode`, no copy).
``cuda`` / ``cuda:N`` (:class:`DeviceDecode`) decodes each chunk into a staging tensor on the device
and copies it into its memory object without blocking, on a stream of the calling thread's own
(:mod:`scd_store.service.device_staging`): it first waits for the caller's current stream (inside a
vLLM worker, the engine's), then runs the decodes and copies; the batch synchronises that private
stream alone (never the engine's) before it returns, failed or not, so LMCache never reads (or
frees) a memory object with a copy still in flight. One staging tensor is reused through a batch
(``KVService.get`` asks for chunk ``i``'s buffers once chunk ``i - 1`` is decoded; stream order puts
the copy of ``i - 1`` before the decode of ``i``): a batch holds one chunk's KV on the device,
whatever its length. A device with no room for it ends the run there (a miss from that chunk on,
logged once), as a full LMCache allocator does.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

import torch

from scd_store.adapters.lmcache.layout import kv_2ltd_views
from scd_store.service.device_staging import Copies, PrivateStreams, StagedRun, StagingBuffer
from scd_store.service.devices import resolve_decode_device
from scd_store.service.log_once import LogOnce

Pair = tuple[torch.Tensor, torch.Tensor]
log = logging.getLogger("scd_store.adapters.lmcache")
_once = LogOnce(log)

decode_device = resolve_decode_device  # the device ``decode_device`` names, checked at start



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
    """One get's chunks decoded into a device staging tensor, each copied into its host tensor
    (a :class:`~scd_store.service.device_staging.StagedRun` through ``copies``)."""

    def __init__(self, heads: int, device: torch.device, copies: Copies) -> None:
        super().__init__(heads)
        self.device, self.copies = device, copies
        self._run = StagedRun(copies, StagingBuffer(device, "chunk", _once))  # one staging tensor per batch

    def __enter__(self) -> StagedBatch:
        self._run.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._run.__exit__(exc_type, exc, tb)  # every queued copy lands before LMCache reads or frees a host tensor

    def buffers(self, host: torch.Tensor) -> Pair | None:
        staging = self._run.stage_into(host)  # the previous chunk's copy is queued before this chunk's decode
        return None if staging is None else kv_2ltd_views(staging, self.heads)

    def land(self, decoded: int) -> None:
        """Queue the last chunk's copy when it decoded (the wait comes when the batch closes)."""
        self._run.land(decoded)


class HostDecode:
    """``decode_device: cpu``: decode straight into LMCache's host memory objects."""

    device = torch.device("cpu")

    def batch(self, heads: int) -> HostBatch:
        return HostBatch(heads)


class DeviceDecode:
    """``decode_device: cuda[:N]``: decode on the device, copy into the host memory objects."""

    def __init__(self, device: torch.device, copies: Copies | None = None) -> None:
        self.device = device
        self.copies: Copies = copies if copies is not None else PrivateStreams(device)  # shared by the threads

    def batch(self, heads: int) -> StagedBatch:
        return StagedBatch(heads, self.device, self.copies)


def decode_target(setting: str, cuda: Any = torch.cuda) -> HostDecode | DeviceDecode:
    """What ``decode_device`` says, checked now (a :class:`SettingsError` names it when it cannot be met)."""
    device = decode_device(setting, cuda)
    return HostDecode() if device.type == "cpu" else DeviceDecode(device)
