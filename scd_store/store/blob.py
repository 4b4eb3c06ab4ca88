"""The code-blob format: one checksummed, optionally signed, self-describing value per chunk.

Layout (all integers little-endian)::

    offset  size  field
    0       4     magic b"SCDB"
    4       2     format version (u16, 3)
    6       2     flags (u16; bit 0: signed)
    8       4     header length H (u32, at most MAX_HEADER_BYTES)
    12      8     payload length P (u64)
    20      H     header: UTF-8 JSON object (codec id, space fingerprint, token count)
    20+H    P     payload: the codec's serialised bytes, opaque to the store
    20+H+P  16    checksum: xxh3-128 over bytes [0, 20+H+P)
    signed blobs only:
    +16     1     key id length L
    +17     L     key id (ASCII: which key signed it)
    +17+L   64    signature: Ed25519 over "scd-store/blob/v3" || 0x00 || store key || 0x00 ||
                  SHA-256(every byte before the signature)

The checksum tells corruption; the signature tells a blob this space's producer wrote under this
key (:mod:`scd_store.store.signing`): a forged blob, or a genuine one copied to another key, fails
it, and readers hold only public keys, so no reader can make one. No pickle: the header is JSON
(non-finite numbers refused), the payload raw bytes. Every length is checked against the bytes
present before anything is allocated.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from scd_store.errors import ScdStoreError
from scd_store.store import strict_json
from scd_store.store.keyring import Keyring
from scd_store.store.keys import KEY_FORMAT
from scd_store.store.signing import SIGNATURE_SIZE, SigningKey, VerifyKey

MAGIC = b"SCDB"
FORMAT_VERSION = KEY_FORMAT
FLAG_SIGNED = 1
_PREFIX = struct.Struct("<4sHHIQ")
PREFIX_SIZE = _PREFIX.size  # 20
CHECKSUM_SIZE = 16
MAX_HEADER_BYTES = 64 << 10
_HEADER_FIELDS = ("codec_id", "space_fingerprint", "token_count")
_SIGNED_CONTEXT = b"scd-store/blob/v3\0"


class BlobError(ScdStoreError, ValueError):
    """A blob failed a check (magic, version, length, checksum, header, bounds): never decode it."""


class SignatureError(BlobError):
    """A blob without a valid signature where signatures are required (unsigned, unknown or expired
    key, forged, or moved to another key): never decode it."""


class UnknownKey(SignatureError):
    """A blob signed with a key this keyring does not hold (or no longer: rotated out, expired, its file gone): a
    miss, but no evidence of damage (this process's keys may lag a rotation), so never deleted for it."""


class ForeignBlob(BlobError):
    """A well-formed blob of another space generation or codec: a miss, not damage (never deleted)."""


@dataclass(frozen=True, slots=True)
class BlobMeta:
    """What the producer states about a chunk's codes; the store checks it, the codec interprets it."""

    codec_id: str
    space_fingerprint: str
    token_count: int

    def __post_init__(self) -> None:
        if not isinstance(self.codec_id, str) or not self.codec_id:
            raise BlobError("codec_id must be a non-empty string")
        if not isinstance(self.space_fingerprint, str) or not self.space_fingerprint:
            raise BlobError("space_fingerprint must be a non-empty string")
        if isinstance(self.token_count, bool) or not isinstance(self.token_count, int) or self.token_count < 0:
            raise BlobError(f"token_count must be an int >= 0, got {self.token_count!r}")

    def to_json(self) -> dict[str, Any]:
        return {"codec_id": self.codec_id, "space_fingerprint": self.space_fingerprint,
                "token_count": self.token_count}


@dataclass(frozen=True, slots=True)
class Blob:
    """A decoded, verified blob: its metadata, a zero-copy view of its payload, where the payload starts in the
    blob, and the id of the key whose signature was checked ("" when none was: unsigned, or no keyring)."""

    meta: BlobMeta
    payload: memoryview
    payload_offset: int = 0
    key_id: str = ""


def _signed_message(key: str, *body: bytes | memoryview) -> bytes:
    """What a blob's signature covers: its store key and a SHA-256 of every byte before the signature."""
    digest = hashlib.sha256()
    for part in body:
        digest.update(part)
    return _SIGNED_CONTEXT + key.encode() + b"\0" + digest.digest()


def encode_blob(meta: BlobMeta, payload: bytes | bytearray | memoryview, *, key: str = "",
                signer: SigningKey | None = None) -> bytes:
    """Serialise ``meta`` and ``payload`` into one checksummed blob, signed for store ``key`` when a
    ``signer`` (a private key) is given."""
    payload = memoryview(payload).cast("B")
    header = json.dumps(meta.to_json(), separators=(",", ":"), sort_keys=True).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise BlobError(f"blob header is {len(header)} bytes, more than {MAX_HEADER_BYTES}")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, FLAG_SIGNED if signer else 0, len(header), payload.nbytes)
    hasher = xxhash.xxh3_128(prefix)
    hasher.update(header)
    hasher.update(payload)
    parts = [prefix, header, payload, hasher.digest()]
    if signer is None:
        return b"".join(parts)
    key_id = signer.key_id.encode()
    parts += [bytes([len(key_id)]), key_id]
    return b"".join([*parts, signer.sign(_signed_message(key, *parts))])


def _meta_from_json(header: bytes) -> BlobMeta:
    try:
        obj = strict_json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BlobError(f"blob header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != set(_HEADER_FIELDS):
        raise BlobError(f"blob header fields are wrong: {sorted(obj) if isinstance(obj, dict) else type(obj)}")
    return BlobMeta(obj["codec_id"], obj["space_fingerprint"], obj["token_count"])


def check_signer(key_id: str, space_id: str, keyring: Keyring) -> VerifyKey:
    """The public key ``key_id`` of ``space_id`` this keyring holds now; :class:`UnknownKey` when it holds none
    (or no longer: rotated out, expired, its file gone)."""
    public = keyring.verifier(space_id, key_id)
    if public is None:
        raise UnknownKey(f"blob is signed with key {key_id!r}, which this keyring does not hold (or no longer)")
    return public


def _verify_signature(view: memoryview, end: int, key: str, space_id: str, keyring: Keyring,
                      verified_before: bool = False) -> str:
    """Check a signed blob's trailer after ``end`` (the checksum's end); returns the id of the key it names."""
    if end + 1 > view.nbytes:
        raise BlobError("signed blob is truncated before its key id")
    id_len = view[end]
    total = end + 1 + id_len + SIGNATURE_SIZE
    if total != view.nbytes:
        raise BlobError(f"blob length {view.nbytes} does not match its signed trailer ({total}): truncated or extended")
    try:
        key_id = bytes(view[end + 1:end + 1 + id_len]).decode("ascii")
    except UnicodeDecodeError:
        raise SignatureError("blob key id is not ASCII") from None
    public = check_signer(key_id, space_id, keyring)
    if verified_before:  # this process checked its signature when it took it in: its key must still be held
        return key_id
    if not public.verify(_signed_message(key, view[:total - SIGNATURE_SIZE]), view[total - SIGNATURE_SIZE:]):
        raise SignatureError("blob signature does not verify: forged, or moved from another key")
    return key_id


def check_meta(meta: BlobMeta, *, expect_space_fingerprint: str | None = None, expect_codec_id: str | None = None,
               max_token_count: int | None = None) -> None:
    """The header checks of :func:`decode_blob` against what its reader expects (token bound, space generation,
    codec): :class:`BlobError` out of bounds, :class:`ForeignBlob` for another generation's or codec's blob."""
    if max_token_count is not None and not 0 < meta.token_count <= max_token_count:
        raise BlobError(f"blob covers {meta.token_count} tokens; a chunk of this space holds 1 to {max_token_count}")
    if expect_space_fingerprint is not None and meta.space_fingerprint != expect_space_fingerprint:
        raise ForeignBlob(f"blob is from space fingerprint {meta.space_fingerprint!r}, "
                          f"expected {expect_space_fingerprint!r}")
    if expect_codec_id is not None and meta.codec_id != expect_codec_id:
        raise ForeignBlob(f"blob codec {meta.codec_id!r}, expected {expect_codec_id!r}")


def decode_blob(data: bytes | bytearray | memoryview, *, key: str = "", space_id: str = "",
                keyring: Keyring | None = None, verified_before: bool = False,
                expect_space_fingerprint: str | None = None,
                expect_codec_id: str | None = None, max_token_count: int | None = None) -> Blob:
    """Verify and split a blob read under store ``key`` of ``space_id``. With a ``keyring`` the blob
    must carry a valid signature (:class:`SignatureError`; :class:`UnknownKey` when its key is not held), or with
    ``verified_before`` (a blob this process checked when it took it in) at least a key still held; without
    one, a signed blob's trailer is checked
    for its framing only. Raises :class:`BlobError` on any defect; never returns garbage."""
    view = memoryview(data).cast("B")
    n = view.nbytes
    if n < PREFIX_SIZE + CHECKSUM_SIZE:
        raise BlobError(f"blob is {n} bytes, shorter than the {PREFIX_SIZE + CHECKSUM_SIZE}-byte minimum")
    magic, version, flags, header_len, payload_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise BlobError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise BlobError(f"blob format version {version} is not supported (this build reads {FORMAT_VERSION})")
    if flags & ~FLAG_SIGNED:
        raise BlobError(f"unknown blob flags {flags:#x}")
    body_len = PREFIX_SIZE + header_len + payload_len
    end = body_len + CHECKSUM_SIZE
    signed = bool(flags & FLAG_SIGNED)
    if header_len > MAX_HEADER_BYTES or end > n or (not signed and end != n):
        raise BlobError(f"blob length {n} does not match its header ({header_len} + {payload_len} + framing): "
                        "truncated or extended")
    if xxhash.xxh3_128(view[:body_len]).digest() != view[body_len:end]:
        raise BlobError("blob checksum mismatch: corrupted")
    if keyring is not None and not signed:
        raise SignatureError("blob is unsigned and this store requires signed blobs")
    key_id = ""
    if signed:
        if keyring is not None:
            key_id = _verify_signature(view, end, key, space_id, keyring, verified_before)
        elif end + 1 > n or end + 1 + view[end] + SIGNATURE_SIZE != n:
            raise BlobError("signed blob trailer does not match its length: truncated or extended")
    meta = _meta_from_json(bytes(view[PREFIX_SIZE:PREFIX_SIZE + header_len]))
    check_meta(meta, expect_space_fingerprint=expect_space_fingerprint, expect_codec_id=expect_codec_id,
               max_token_count=max_token_count)
    start = PREFIX_SIZE + header_len
    return Blob(meta, view[start:body_len], start, key_id)
