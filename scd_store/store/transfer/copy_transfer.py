"""The in-process fallback: readers copy straight out of a source's arena (no NIXL needed)."""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence

import torch

from scd_store.store.transfer.arena import Arena
from scd_store.store.transfer.base import (
    DEFAULT_MAX_BATCH_BYTES,
    BlobReader,
    BlobRef,
    BlobSource,
    SourceInfo,
    TransferError,
    split_batches,
)

_sources: weakref.WeakValueDictionary[str, CopyBlobSource] = weakref.WeakValueDictionary()
_lock = threading.Lock()


class CopyBlobSource(BlobSource):
    """A source readable only from this process."""

    def __init__(self, size: int, device: torch.device | str = "cpu", name: str | None = None) -> None:
        self.arena = Arena(size, device)
        self.name = name or f"scd-copy-{uuid.uuid4().hex[:12]}"
        self.lock = threading.Lock()
        with _lock:
            _sources[self.name] = self

    def publish(self, blobs: Mapping[str, bytes]) -> list[BlobRef]:
        with self.lock:
            return self.arena.put(blobs)

    def info(self) -> SourceInfo:
        return SourceInfo(self.name, "copy", self.arena.mem_type, 0, self.arena.size, self.arena.device_id)

    def close(self) -> None:
        with _lock:
            _sources.pop(self.name, None)


class CopyBlobReader(BlobReader):
    """Reads from :class:`CopyBlobSource` objects of this process (one "transfer" per batch, like NIXL)."""

    def __init__(self, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> None:
        if max_batch_bytes <= 0:
            raise TransferError(f"max_batch_bytes must be > 0, got {max_batch_bytes}")
        self.max_batch_bytes = max_batch_bytes
        self.transfers = 0
        self._peers: dict[str, SourceInfo] = {}

    def connect(self, info: SourceInfo | bytes) -> str:
        info = SourceInfo.from_bytes(info) if isinstance(info, bytes) else info
        if info.kind != "copy":
            raise TransferError(f"the copy reader cannot reach a {info.kind!r} source")
        self._peers[info.name] = info
        return info.name

    def read(self, source: str, refs: Sequence[BlobRef], timeout_s: float = 2.0) -> list[bytes | None]:
        with _lock:
            src = _sources.get(source)
        out: list[bytes | None] = [None] * len(refs)
        if src is None or source not in self._peers:
            return out
        deadline = time.monotonic() + timeout_s
        for group in split_batches(refs, self.max_batch_bytes):
            if time.monotonic() >= deadline:
                break
            self.transfers += 1
            with src.lock:
                data = src.arena.buffer
                for i in group:
                    ref = refs[i]
                    if ref.offset + ref.length <= src.arena.size:
                        out[i] = data[ref.offset:ref.offset + ref.length].cpu().numpy().tobytes()
        return out

    def close(self) -> None:
        self._peers.clear()
