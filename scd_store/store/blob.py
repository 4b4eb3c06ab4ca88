"""The code-blob format: one checksummed, self-describing value per chunk per space.

Layout (all integers little-endian)::

    offset  size  field
    0       4     magic b"SCDB"
    4       2     format version (u16)
    6       2     flags (u16, 0)
    8       4     header length H (u32)
    12      8     payload length P (u64)
    20      H     header: UTF-8 JSON object (codec id, space fingerprint, token count, layer roles,
                  code dtypes, bit widths, sections)
    20+H    P     payload: the codec's serialised bytes, opaque to the store
    20+H+P  16    checksum: xxh3-128 over bytes [0, 20+H+P)

``sections`` are ``{"name", "offset", "length"}`` entries inside the payload (offsets from the
payload start). No pickle: the header is JSON, the payload raw bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import xxhash

MAGIC = b"SCDB"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHHIQ")
PREFIX_SIZE = _PREFIX.size  # 20
CHECKSUM_SIZE = 16
MAX_HEADER_BYTES = 1 << 20
_HEADER_FIELDS = ("codec_id", "space_fingerprint", "token_count", "layer_roles", "code_dtypes", "bit_widths",
                  "sections")


class BlobError(ValueError):
    """A blob failed a check (magic, version, length, checksum, header, fingerprint): never decode it."""


@dataclass(frozen=True, slots=True)
class Section:
    """A named byte range inside the payload."""

    name: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class BlobMeta:
    """What the producer states about a chunk's codes; the store checks it, the codec interprets it."""

    codec_id: str
    space_fingerprint: str
    token_count: int
    layer_roles: tuple[str, ...] = ()
    code_dtypes: tuple[str, ...] = ()
    bit_widths: tuple[int, ...] = ()
    sections: tuple[Section, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.codec_id, str) or not self.codec_id:
            raise BlobError("codec_id must be a non-empty string")
        if not isinstance(self.space_fingerprint, str) or not self.space_fingerprint:
            raise BlobError("space_fingerprint must be a non-empty string")
        if isinstance(self.token_count, bool) or not isinstance(self.token_count, int) or self.token_count < 0:
            raise BlobError(f"token_count must be an int >= 0, got {self.token_count!r}")
        if not all(isinstance(r, str) for r in self.layer_roles):
            raise BlobError("layer_roles must be strings")
        if not all(isinstance(d, str) for d in self.code_dtypes):
            raise BlobError("code_dtypes must be strings")
        if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 64 for b in self.bit_widths):
            raise BlobError("bit_widths must be ints in [0, 64]")

    def to_json(self) -> dict[str, Any]:
        return {
            "codec_id": self.codec_id,
            "space_fingerprint": self.space_fingerprint,
            "token_count": self.token_count,
            "layer_roles": list(self.layer_roles),
            "code_dtypes": list(self.code_dtypes),
            "bit_widths": list(self.bit_widths),
            "sections": [[s.name, s.offset, s.length] for s in self.sections],
        }


@dataclass(frozen=True, slots=True)
class Blob:
    """A decoded, verified blob: its metadata and a zero-copy view of its payload."""

    meta: BlobMeta
    payload: memoryview


def _check_sections(sections: tuple[Section, ...], payload_len: int) -> None:
    for s in sections:
        if not isinstance(s.name, str) or not isinstance(s.offset, int) or not isinstance(s.length, int):
            raise BlobError(f"malformed section {s!r}")
        if s.offset < 0 or s.length < 0 or s.offset + s.length > payload_len:
            raise BlobError(f"section {s.name!r} [{s.offset}, +{s.length}) lies outside the {payload_len}-byte payload")


def encode_blob(meta: BlobMeta, payload: bytes | bytearray | memoryview) -> bytes:
    """Serialise ``meta`` and ``payload`` into one checksummed blob."""
    payload = memoryview(payload).cast("B")
    _check_sections(meta.sections, payload.nbytes)
    header = json.dumps(meta.to_json(), separators=(",", ":"), sort_keys=True).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise BlobError(f"blob header is {len(header)} bytes, more than {MAX_HEADER_BYTES}")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header), payload.nbytes)
    hasher = xxhash.xxh3_128(prefix)
    hasher.update(header)
    hasher.update(payload)
    return b"".join((prefix, header, payload, hasher.digest()))


def _meta_from_json(header: bytes) -> BlobMeta:
    try:
        obj = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BlobError(f"blob header is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(obj, dict) or set(obj) != set(_HEADER_FIELDS):
        raise BlobError(f"blob header fields are wrong: {sorted(obj) if isinstance(obj, dict) else type(obj)}")
    try:
        sections = tuple(Section(str(n), int(o), int(ln)) for n, o, ln in obj["sections"])
        return BlobMeta(obj["codec_id"], obj["space_fingerprint"], obj["token_count"], tuple(obj["layer_roles"]),
                        tuple(obj["code_dtypes"]), tuple(obj["bit_widths"]), sections)
    except (TypeError, ValueError) as exc:
        raise BlobError(f"blob header is malformed: {exc}") from exc


def decode_blob(data: bytes | bytearray | memoryview, *, expect_space_fingerprint: str | None = None,
                expect_codec_id: str | None = None) -> Blob:
    """Verify and split a blob. Raises :class:`BlobError` on any defect; never returns garbage."""
    view = memoryview(data).cast("B")
    n = view.nbytes
    if n < PREFIX_SIZE + CHECKSUM_SIZE:
        raise BlobError(f"blob is {n} bytes, shorter than the {PREFIX_SIZE + CHECKSUM_SIZE}-byte minimum")
    magic, version, flags, header_len, payload_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise BlobError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise BlobError(f"blob format version {version} is not supported (this build reads {FORMAT_VERSION})")
    if flags != 0:
        raise BlobError(f"unknown blob flags {flags:#x}")
    body_len = PREFIX_SIZE + header_len + payload_len
    if header_len > MAX_HEADER_BYTES or body_len + CHECKSUM_SIZE != n:
        raise BlobError(f"blob length {n} does not match its header ({header_len} + {payload_len} + framing): "
                        "truncated or extended")
    if xxhash.xxh3_128(view[:body_len]).digest() != view[body_len:]:
        raise BlobError("blob checksum mismatch: corrupted")
    meta = _meta_from_json(bytes(view[PREFIX_SIZE:PREFIX_SIZE + header_len]))
    _check_sections(meta.sections, payload_len)
    if expect_space_fingerprint is not None and meta.space_fingerprint != expect_space_fingerprint:
        raise BlobError(f"blob is from space fingerprint {meta.space_fingerprint!r}, "
                        f"expected {expect_space_fingerprint!r}")
    if expect_codec_id is not None and meta.codec_id != expect_codec_id:
        raise BlobError(f"blob codec {meta.codec_id!r}, expected {expect_codec_id!r}")
    return Blob(meta, view[PREFIX_SIZE + header_len:body_len])
