"""Chunk keys: ``scd:{space_id}:{generation}:{chunk_hash_hex}``, one key scheme for every caller.

Keys are made here (:func:`make_key`, :func:`hash_keys`) and read back here (:func:`parse_key` into a
:class:`StoreKey`, :func:`space_of`); no other module builds or splits one by hand.

A key names a 16-byte chunk hash in one generation of a space: ``generation`` is
``v{blob format}.{xxh3-64 of the space fingerprint}`` (:func:`generation_of`), so two bundle
generations of a space (a rollout) and two blob formats never share a key. Engines bring their own chain of chunk hashes
(LMCache's, SGLang's); everyone else turns tokens into hashes with :func:`chunk_hashes`, a
chained SHA-256 cut to 16 bytes: ``h_0 = ROOT``, ``h_i = sha256(h_{i-1} || le_int64(tokens_i))[:16]``.
Tenants choose the tokens, so the chain must resist second preimages (a prompt crafted to hash like
another tenant's would be stored, and served, under its key): a cryptographic hash, never a fast
non-cryptographic one, nor Python's ``hash``. Only whole chunks are hashed: a trailing partial chunk
has no key.
"""

from __future__ import annotations

import array as _array
import hashlib
import re
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import xxhash

from scd_store.errors import ScdStoreError

DEFAULT_CHUNK_SIZE = 256
KEY_PREFIX = "scd"
KEY_FORMAT = 3  # the blob format version the keys name (scd_store.store.blob.FORMAT_VERSION)
ROOT_HASH = hashlib.sha256(b"scd-store/chunk-chain/v2").digest()[:16]
_SPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEX_RE = re.compile(r"^[0-9a-f]{32}$")
_GENERATION_RE = re.compile(r"^v[0-9]+\.[0-9a-f]{16}$")


class KeyError_(ScdStoreError, ValueError):  # noqa: N801 - avoid shadowing the builtin KeyError
    """Invalid tokens, space id or key string."""


def validate_space_id(space_id: str) -> str:
    """Return ``space_id`` if it is 1-128 chars of ``[A-Za-z0-9._-]`` starting alphanumeric."""
    if not isinstance(space_id, str) or not _SPACE_RE.fullmatch(space_id):
        raise KeyError_(f"invalid space id {space_id!r}: use 1-128 characters [A-Za-z0-9._-], starting alphanumeric")
    return space_id


def validate_chunk_size(chunk_size: int) -> int:
    """Return ``chunk_size`` if it is a positive int (tokens per chunk)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise KeyError_(f"chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Validate token ids and return them as a little-endian int64 array."""
    if isinstance(tokens, np.ndarray):
        array = tokens
    elif isinstance(tokens, (list, tuple)):  # fast path: array.array converts a list ~2x faster than numpy
        try:
            array = np.frombuffer(_array.array("q", tokens), dtype=np.int64)
        except (TypeError, OverflowError) as exc:
            raise KeyError_(f"token ids must be ints in int64 range: {exc}") from exc
    else:
        if isinstance(tokens, (str, bytes)):
            raise KeyError_(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
        try:
            array = np.asarray(tokens)
        except (OverflowError, ValueError) as exc:
            raise KeyError_(f"tokens must be a flat sequence of ints in int64 range: {exc}") from exc
    if array.ndim != 1:
        raise KeyError_(f"tokens must be one flat sequence, got shape {array.shape}")
    if array.size == 0:
        return array.astype("<i8")
    if array.dtype.kind not in "iu":
        raise KeyError_(f"token ids must be ints, got dtype {array.dtype} (e.g. {array.flat[0]!r})")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and int(array.max()) > np.iinfo(np.int64).max:
        raise KeyError_("token id out of int64 range")
    if array.dtype.kind == "i" and int(array.min()) < 0:
        raise KeyError_(f"token ids must be >= 0, got {int(array.min())}")
    return array.astype("<i8", copy=False)


def chunk_hashes(tokens: Sequence[int] | np.ndarray, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[bytes]:
    """The chained 16-byte hashes of every whole chunk of ``tokens`` (a trailing partial chunk is dropped)."""
    validate_chunk_size(chunk_size)
    array = token_array(tokens)
    count = array.size // chunk_size
    data = array[: count * chunk_size].tobytes()
    step = chunk_size * 8
    parent = ROOT_HASH
    out: list[bytes] = []
    sha256 = hashlib.sha256
    for i in range(count):
        parent = sha256(parent + data[i * step:(i + 1) * step]).digest()[:16]
        out.append(parent)
    return out


def generation_of(fingerprint: str, version: int = KEY_FORMAT) -> str:
    """The key generation of a space fingerprint: ``v{version}.{xxh3-64 hex of the fingerprint}``."""
    if not isinstance(fingerprint, str) or not fingerprint:
        raise KeyError_(f"a space fingerprint must be a non-empty string, got {fingerprint!r}")
    return f"v{version}.{xxhash.xxh3_64_hexdigest(fingerprint.encode())}"


def _prefix(space_id: str, generation: str) -> str:
    validate_space_id(space_id)
    if not isinstance(generation, str) or not _GENERATION_RE.fullmatch(generation):
        raise KeyError_(f"invalid key generation {generation!r} (expected 'v<format>.<16 hex>': generation_of)")
    return f"{KEY_PREFIX}:{space_id}:{generation}:"


def make_key(space_id: str, generation: str, chunk_hash: bytes | str) -> str:
    """``scd:{space_id}:{generation}:{hex}`` for one chunk hash (16 bytes or 32 hex chars)."""
    prefix = _prefix(space_id, generation)
    hex_ = chunk_hash.hex() if isinstance(chunk_hash, bytes) else chunk_hash
    if not _HEX_RE.fullmatch(hex_):
        raise KeyError_(f"chunk hash must be 16 bytes / 32 lowercase hex chars, got {hex_!r}")
    return prefix + hex_


def hash_keys(space_id: str, generation: str, hashes: Sequence[bytes]) -> list[str]:
    """Keys of chunk hashes (16 bytes each: :func:`chunk_hashes`, or an engine's own, e.g. LMCache's or
    SGLang's) in one ``generation`` (:func:`generation_of`) of ``space_id``, in order."""
    prefix = _prefix(space_id, generation)
    keys = []
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != 16:
            raise KeyError_(f"chunk hash must be 16 bytes, got {h!r}")
        keys.append(prefix + h.hex())
    return keys


class StoreKey(NamedTuple):
    """The parts of a store key (a tuple: ``space_id, generation, chunk_hex = parse_key(key)``)."""

    space_id: str
    generation: str
    chunk_hex: str

    @property
    def scope(self) -> str:
        """The key's space generation, ``{space_id}:{generation}`` (:func:`scope_of`)."""
        return scope_of(self.space_id, self.generation)


def scope_of(space_id: str, generation: str) -> str:
    """``{space_id}:{generation}``: one generation of a space, as shared tiers name the reports kept for it."""
    return f"{space_id}:{generation}"


def parse_key(key: str) -> StoreKey:
    """Split a key into its :class:`StoreKey`; raises :class:`KeyError_` on a malformed key."""
    parts = key.split(":") if isinstance(key, str) else []
    if len(parts) != 4 or parts[0] != KEY_PREFIX or not _HEX_RE.fullmatch(parts[3]) \
            or not _GENERATION_RE.fullmatch(parts[2]):
        raise KeyError_(f"not a store key: {key!r} (expected 'scd:<space_id>:v<format>.<16 hex>:<32 hex>')")
    validate_space_id(parts[1])
    return StoreKey(parts[1], parts[2], parts[3])


def space_of(key: str) -> str:
    """The space id of a store key, or "" for a malformed one (a stats label: never an error)."""
    try:
        return parse_key(key).space_id
    except KeyError_:
        return ""
