"""The transfer interface: blob sources (producer side) and readers (consumer side).

What crosses process boundaries is bytes we define: a :class:`SourceInfo` (a JSON header plus
the NIXL agent's own metadata blob) and :class:`BlobRef` lists (JSON). Never pickle (NIXL's own
``get_serialized_descs`` pickles, so descriptors are rebuilt from plain addresses here). Both are
parsed strictly (another process wrote them): ints are JSON ints in range (no floats, bools,
strings, NaN or Infinity), every field is checked before anything is allocated.
"""

from __future__ import annotations

import json
import re
import struct
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scd_store.errors import ScdStoreError
from scd_store.store.strict_json import loads

INFO_FORMAT = "scd-xfer"
INFO_VERSION = 1
MAX_INFO_BYTES = 1 << 20  # a serialised SourceInfo (header + agent metadata)
MAX_INFO_HEADER_BYTES = 64 << 10
MAX_ADDRESS = 1 << 64
DEFAULT_MAX_BATCH_BYTES = 64 << 20
_LEN = struct.Struct("<I")
_SOURCE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch
_INFO_FIELDS = {"format", "version", "name", "kind", "mem_type", "base", "size", "device_id"}
KINDS, MEM_TYPES = ("nixl", "copy"), ("DRAM", "VRAM")


class TransferError(ScdStoreError, RuntimeError):
    """A transfer that could not be set up (bad peer info, no memory). Failed reads are misses, not errors."""


strict_json = loads  # JSON another process wrote: non-finite numbers refused (scd_store.store.strict_json)


def strict_int(value: Any, lo: int, hi: int) -> int | None:
    """``value`` when it is a real int (not a bool, float or string) in ``[lo, hi]``, else None."""
    if type(value) is not int or not lo <= value <= hi:
        return None
    return value


def valid_source_name(name: Any) -> bool:
    """1-128 characters ``[A-Za-z0-9._-]`` starting alphanumeric (names are also file stems)."""
    return isinstance(name, str) and bool(_SOURCE_RE.fullmatch(name))


@dataclass(frozen=True, slots=True)
class BlobRef:
    """Where one published blob lives in its source's registered memory."""

    key: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if strict_int(self.offset, 0, MAX_ADDRESS - 1) is None or strict_int(self.length, 0, MAX_ADDRESS - 1) is None:
            raise TransferError(f"bad blob ref {self.key!r}: offset {self.offset!r}, length {self.length!r}")

    def to_list(self) -> list:
        return [self.key, self.offset, self.length]


def refs_to_json(refs: Sequence[BlobRef]) -> bytes:
    return json.dumps([r.to_list() for r in refs]).encode()


def refs_from_json(data: bytes) -> list[BlobRef]:
    """Refs from :func:`refs_to_json`; :class:`TransferError` on anything else."""
    try:
        items = strict_json(data)
        if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 3 and isinstance(i[0], str)
                                                  for i in items):
            raise TypeError("expected a list of [key, offset, length]")
        return [BlobRef(k, o, n) for k, o, n in items]
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise TransferError(f"malformed blob refs: {exc}") from None


def split_batches(refs: Sequence[BlobRef], max_bytes: int) -> list[list[int]]:
    """Indices of ``refs`` in consecutive groups of at most ``max_bytes`` each (one transfer per group);
    a ref longer than ``max_bytes`` is in none (a miss)."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, ref in enumerate(refs):
        if ref.length > max_bytes:
            continue
        if current and used + ref.length > max_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += ref.length
    if current:
        groups.append(current)
    return groups


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

    def __post_init__(self) -> None:
        if not valid_source_name(self.name) or self.kind not in KINDS or self.mem_type not in MEM_TYPES:
            raise TransferError(f"bad transfer info: name {self.name!r}, kind {self.kind!r}, mem {self.mem_type!r}")
        base, size = strict_int(self.base, 0, MAX_ADDRESS - 1), strict_int(self.size, 1, MAX_ADDRESS - 1)
        if base is None or size is None or base + size > MAX_ADDRESS or strict_int(self.device_id, 0, 1 << 16) is None:
            raise TransferError(f"bad transfer info region: base {self.base!r}, size {self.size!r}, "
                                f"device {self.device_id!r}")
        if not isinstance(self.agent_metadata, bytes):
            raise TransferError("agent metadata must be bytes")

    def to_bytes(self) -> bytes:
        header = json.dumps({"format": INFO_FORMAT, "version": INFO_VERSION, "name": self.name, "kind": self.kind,
                             "mem_type": self.mem_type, "base": self.base, "size": self.size,
                             "device_id": self.device_id}).encode()
        return _LEN.pack(len(header)) + header + self.agent_metadata

    @classmethod
    def from_bytes(cls, data: bytes) -> SourceInfo:
        """Parse :meth:`to_bytes`' output; :class:`TransferError` on anything else."""
        try:
            if len(data) > MAX_INFO_BYTES:
                raise TransferError(f"transfer info is {len(data)} bytes, more than {MAX_INFO_BYTES}")
            (n,) = _LEN.unpack_from(data)
            if n > MAX_INFO_HEADER_BYTES or _LEN.size + n > len(data):
                raise TransferError(f"transfer info header length {n} does not fit its {len(data)} bytes")
            header = strict_json(bytes(data[_LEN.size:_LEN.size + n]))
            if not isinstance(header, dict) or header.get("format") != INFO_FORMAT:
                raise TransferError("not scd-store transfer info")
            if header.get("version") != INFO_VERSION or type(header.get("version")) is not int:
                raise TransferError(f"transfer info version {header.get('version')!r} is not {INFO_VERSION}")
            if set(header) != _INFO_FIELDS:
                raise TransferError(f"transfer info fields are wrong: {sorted(header)}")
            return cls(header["name"], header["kind"], header["mem_type"], header["base"], header["size"],
                       header["device_id"], bytes(data[_LEN.size + n:]))
        except (struct.error, ValueError, KeyError, TypeError, RecursionError, OverflowError) as exc:
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
    """Reads published blobs from connected sources, many per transfer: at most ``max_batch_bytes`` per
    transfer (a larger batch takes several; :attr:`transfers` counts them)."""

    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    transfers: int = 0

    @abstractmethod
    def connect(self, info: SourceInfo | bytes) -> str:
        """Add a source; returns its name."""

    @abstractmethod
    def read(self, source: str, refs: Sequence[BlobRef], timeout_s: float = 2.0) -> list[bytes | None]:
        """The blobs at ``refs``, in as few transfers as ``max_batch_bytes`` allows, all within ``timeout_s``;
        None for each blob of a transfer that fails or times out (and for a ref longer than ``max_batch_bytes``)."""

    @abstractmethod
    def close(self) -> None:
        """Release local buffers and connections."""

    def __enter__(self) -> BlobReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
