"""Peer directory entries: where one blob sits, signed by its space's producer.

An entry says that blob ``key`` lies at ``offset`` / ``length`` in the registered memory of source
``source``, whose :class:`~scd_store.store.transfer.base.SourceInfo` bytes hash (SHA-256) to
``info_digest``. A producer signs it with its space's Ed25519 private key; the signature covers::

    b"scd-store/peer/v1\\0" || key || 0x00 || source || 0x00 || decimal(offset) || 0x00 ||
    decimal(length) || 0x00 || info_digest (64 lowercase hex)

No field may hold a NUL (keys and source names are checked, numbers are canonical decimals, the
digest is fixed-length hex), so the framing is unambiguous. On the wire an entry is the JSON list
``[source, offset, length, info_digest, key_id, signature_hex]`` (``key_id`` and ``signature`` are
``""`` in an unsigned entry, written only where the operator chose ``allow_unsigned``). Whatever the
directory holds was written by another process: :func:`entry_from_list` refuses anything but exactly
that shape (bools, floats, NaN / Infinity, huge or negative numbers), returning None: a miss.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from scd_store.store.keyring import Keyring
from scd_store.store.keys import KeyError_, parse_key
from scd_store.store.signing import SIGNATURE_SIZE, SigningKey
from scd_store.store.transfer.base import BlobRef, strict_int, strict_json, valid_source_name

ENTRY_CONTEXT = b"scd-store/peer/v1\0"
MAX_ENTRY_BYTES = 2048  # a raw entry (one Redis value, one log line): larger ones are refused unread
MAX_KEY_CHARS = 512
MAX_OFFSET = (1 << 63) - 1
_KEY_RE = re.compile(f"[\\x21-\\x7e]{{1,{MAX_KEY_CHARS}}}")  # printable ASCII: no NUL, no space (fullmatch)
_KEY_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_SIGNATURE_RE = re.compile(f"[0-9a-f]{{{2 * SIGNATURE_SIZE}}}")


def info_digest(info_bytes: bytes) -> str:
    """The SHA-256 hex of a source's serialised :class:`SourceInfo` (what entries are bound to)."""
    return hashlib.sha256(info_bytes).hexdigest()


@dataclass(frozen=True, slots=True)
class LocationEntry:
    """One blob's location, as a producer published it (signed unless ``key_id`` is empty)."""

    key: str
    source: str
    offset: int
    length: int
    info_digest: str
    key_id: str = ""
    signature: str = ""

    @property
    def ref(self) -> BlobRef:
        return BlobRef(self.key, self.offset, self.length)

    @property
    def signed(self) -> bool:
        return bool(self.key_id)

    def message(self) -> bytes:
        """The bytes the signature covers (see the module docstring)."""
        return b"\0".join([ENTRY_CONTEXT + self.key.encode(), self.source.encode(), str(self.offset).encode(),
                           str(self.length).encode(), self.info_digest.encode()])

    @classmethod
    def make(cls, ref: BlobRef, source: str, digest: str, signer: SigningKey | None) -> LocationEntry:
        """The entry of ``ref`` in ``source`` (whose info hashes to ``digest``), signed when ``signer`` is given."""
        entry = cls(ref.key, source, ref.offset, ref.length, digest)
        if signer is None:
            return entry
        return cls(ref.key, source, ref.offset, ref.length, digest, signer.key_id, signer.sign(entry.message()).hex())

    def verify(self, keyring: Keyring) -> bool:
        """Whether the entry carries a valid signature of its key's space (a malformed key: False)."""
        if not self.signed:
            return False
        try:
            space_id = parse_key(self.key).space_id
        except KeyError_:
            return False
        public = keyring.verifier(space_id, self.key_id)
        return public is not None and public.verify(self.message(), bytes.fromhex(self.signature))

    def to_list(self) -> list:
        return [self.source, self.offset, self.length, self.info_digest, self.key_id, self.signature]

    def to_json(self) -> str:
        return json.dumps(self.to_list(), separators=(",", ":"))


def entry_from_list(key: str, items: Any) -> LocationEntry | None:
    """The entry of ``key`` from its decoded JSON list, or None unless it has exactly the entry's shape."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key) or not isinstance(items, list) or len(items) != 6:
        return None
    source, offset, length, digest, key_id, signature = items
    offset, length = strict_int(offset, 0, MAX_OFFSET), strict_int(length, 0, MAX_OFFSET)
    if offset is None or length is None or offset + length > MAX_OFFSET or not valid_source_name(source):
        return None
    if not isinstance(digest, str) or not (digest == "" or _DIGEST_RE.fullmatch(digest)):
        return None
    if not isinstance(key_id, str) or not isinstance(signature, str):
        return None
    signed = bool(key_id or signature)  # a signed entry has both, well formed; an unsigned one neither
    if signed and not (_KEY_ID_RE.fullmatch(key_id) and _SIGNATURE_RE.fullmatch(signature) and digest):
        return None
    return LocationEntry(key, source, offset, length, digest, key_id, signature)


def parse_entry(key: str, raw: Any) -> LocationEntry | None:
    """The entry of ``key`` from its raw JSON bytes (a Redis value), or None when absent or malformed."""
    if raw is None or not isinstance(raw, (bytes, str)) or len(raw) > MAX_ENTRY_BYTES:
        return None
    try:
        return entry_from_list(key, strict_json(raw))
    except (ValueError, TypeError, RecursionError, OverflowError):
        return None
