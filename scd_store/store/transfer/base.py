"""The transfer interface: blob sources (producer side) and readers (consumer side).

What crosses process boundaries is bytes we define: a :class:`SourceInfo` (a JSON header plus
the NIXL agent's own metadata blob) and :class:`BlobRef` lists (JSON). Never pickle (NIXL's own
``get_serialized_descs`` pickles, so descriptors are rebuilt from plain addresses here).
"""

from __future__ import annotations

import json
import struct
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

INFO_FORMAT = "scd-xfer"
INFO_VERSION = 1
_LEN = struct.Struct("<I")


class TransferError(RuntimeError):
    """A transfer that could not be set up (bad peer info, no memory). Failed reads are misses, not errors."""


@dataclass(frozen=True, slots=True)
class BlobRef:
    """Where one published blob lives in its source's registered memory."""

    key: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0:
            raise TransferError(f"bad blob ref {self.key!r}: offset {self.offset}, length {self.length}")

    def to_list(self) -> list:
        return [self.key, self.offset, self.length]


def refs_to_json(refs: Sequence[BlobRef]) -> bytes:
    return json.dumps([r.to_list() for r in refs]).encode()


def refs_from_json(data: bytes) -> list[BlobRef]:
    try:
        items = json.loads(data)
        if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 3 for i in items):
            raise TypeError("expected a list of [key, offset, length]")
        return [BlobRef(str(k), int(o), int(n)) for k, o, n in items]
    except (ValueError, TypeError, RecursionError) as exc:
        raise TransferError(f"malformed blob refs: {exc}") from None


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """What a reader needs to reach a source: its name, kind, memory region and agent metadata."""

    name: str
    kind: str  # "nixl" | "copy"
    mem_type: str  # "DRAM" | "VRAM"
    base: int
    size: int
    device_id: int
    agent_metadata: bytes = b""

    def to_bytes(self) -> bytes:
        header = json.dumps({"format": INFO_FORMAT, "version": INFO_VERSION, "name": self.name, "kind": self.kind,
                             "mem_type": self.mem_type, "base": self.base, "size": self.size,
                             "device_id": self.device_id}).encode()
        return _LEN.pack(len(header)) + header + self.agent_metadata

    @classmethod
    def from_bytes(cls, data: bytes) -> SourceInfo:
        try:
            (n,) = _LEN.unpack_from(data)
            header = json.loads(data[_LEN.size:_LEN.size + n])
            if not isinstance(header, dict) or header.get("format") != INFO_FORMAT:
                raise TransferError("not scd-store transfer info")
            if header.get("version") != INFO_VERSION:
                raise TransferError(f"transfer info version {header.get('version')} is not {INFO_VERSION}")
            return cls(str(header["name"]), str(header["kind"]), str(header["mem_type"]), int(header["base"]),
                       int(header["size"]), int(header["device_id"]), bytes(data[_LEN.size + n:]))
        except (struct.error, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise TransferError(f"malformed transfer info: {exc}") from None


class BlobSource(ABC):
    """Holds blobs in one registered memory region that readers can read directly."""

    @abstractmethod
    def publish(self, blobs: Mapping[str, bytes]) -> list[BlobRef]:
        """Copy ``blobs`` into the region (replacing older ones when full); their refs, in order."""

    @abstractmethod
    def info(self) -> SourceInfo:
        """What readers need to connect."""

    @abstractmethod
    def close(self) -> None:
        """Release the region."""

    def __enter__(self) -> BlobSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlobReader(ABC):
    """Reads published blobs from connected sources, many per transfer."""

    @abstractmethod
    def connect(self, info: SourceInfo | bytes) -> str:
        """Add a source; returns its name."""

    @abstractmethod
    def read(self, source: str, refs: Sequence[BlobRef], timeout_s: float = 2.0) -> list[bytes | None]:
        """The blobs at ``refs`` in one batched transfer; all None when it fails or times out."""

    @abstractmethod
    def close(self) -> None:
        """Release local buffers and connections."""

    def __enter__(self) -> BlobReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
