"""A fixed byte region with a wrap-around bump allocator for published blobs."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import torch

from scd_store.store.transfer.base import BlobRef, TransferError


class Arena:
    """``size`` bytes on ``device``; blobs are appended and the oldest are dropped when it wraps.

    A reader holding a ref to a dropped blob reads other bytes: blobs are checksummed, so that is a
    verified miss downstream, never garbage KV."""

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        if size <= 0:
            raise TransferError(f"arena size must be > 0, got {size}")
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self.size = size
        self._head = 0
        self._live: OrderedDict[str, BlobRef] = OrderedDict()

    def _drop_overlapping(self, start: int, end: int) -> None:
        for key in [k for k, r in self._live.items() if r.offset < end and start < r.offset + r.length]:
            del self._live[key]

    def put(self, blobs: Mapping[str, bytes]) -> list[BlobRef]:
        refs = []
        for key, blob in blobs.items():
            n = len(blob)
            if n > self.size:
                raise TransferError(f"blob {key!r} ({n} bytes) is larger than the arena ({self.size} bytes)")
            if self._head + n > self.size:
                self._head = 0
            self._drop_overlapping(self._head, self._head + n)
            if n:
                self.buffer[self._head:self._head + n].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            ref = BlobRef(key, self._head, n)
            self._live.pop(key, None)
            self._live[key] = ref
            refs.append(ref)
            self._head += n
        return refs

    def live(self) -> dict[str, BlobRef]:
        """Refs of the blobs still in the region."""
        return dict(self._live)

    @property
    def device_id(self) -> int:
        return (self.buffer.device.index or 0) if self.buffer.is_cuda else 0

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.buffer.is_cuda else "DRAM"
