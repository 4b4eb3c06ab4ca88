"""The in-process fallback: readers copy straight out of a source's arena (no NIXL needed)."""

from __future__ import annotations

import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence

import torch

from scd_store.store.transfer.arena import Arena
from scd_store.store.transfer.base import BlobReader, BlobRef, BlobSource, SourceInfo, TransferError

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
    """Reads from :class:`CopyBlobSource` objects of this process."""

    def __init__(self) -> None:
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
        if src is None or source not in self._peers:
            return [None] * len(refs)
        out: list[bytes | None] = []
        with src.lock:
            data = src.arena.buffer
            for ref in refs:
                if ref.offset + ref.length > src.arena.size:
                    out.append(None)
                else:
                    out.append(data[ref.offset:ref.offset + ref.length].cpu().numpy().tobytes())
        return out

    def close(self) -> None:
        self._peers.clear()
