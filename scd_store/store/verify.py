"""A blob read back, checked against the space generation that asked for it.

:func:`verify_blob` runs every check of :func:`~scd_store.store.blob.decode_blob` for a space (framing,
checksum, bounds, the tag when the store holds signing keys, space generation and codec);
:func:`blob_state` names what a producer's repair finds under a key readers reported. A tier that keeps blobs
where reading them back costs a copy (the GPU tier) checks each as it takes it in (:func:`verify_entry`: the
checks a blob passes on its own and under its key) and, on a hit, its kept header against the reader's space
(:func:`verify_held`): together, the checks of :func:`verify_blob`.
"""

from __future__ import annotations

from typing import Literal

from scd_store.store.blob import (
    Blob,
    BlobError,
    BlobMeta,
    ForeignBlob,
    SignatureError,
    UnknownKey,
    check_meta,
    check_signer,
    decode_blob,
)
from scd_store.store.keyring import Keyring
from scd_store.store.keys import KeyError_, generation_of, parse_key
from scd_store.store.records import Space

BlobState = Literal["intact", "foreign", "unknown_key", "bad"]


def verify_blob(key: str, value: bytes, space: Space, keyring: Keyring | None, *, trusted: bool = False) -> Blob:
    """Every check of a blob; ``trusted`` (this process's memory tiers, which hold only blobs it wrote
    or verified before promoting them) skips the signature's arithmetic, not the checksum, nor the check that
    its key is still held (a key rotated out or removed ends what it signed in memory too)."""
    return decode_blob(value, key=key, space_id=space.space_id, keyring=keyring, verified_before=trusted,
                       expect_space_fingerprint=space.fingerprint, max_token_count=space.chunk_size)


def verify_entry(key: str, value: bytes | bytearray | memoryview, keyring: Keyring | None) -> Blob:
    """Every check of a blob that needs no reader's space, as a tier takes it in under ``key``: framing,
    checksum, header, with a ``keyring`` a valid signature for ``key`` (the arithmetic too: nothing is trusted
    on the way in), and its binding to ``key``: its space fingerprint must be the key's generation
    (:class:`~scd_store.store.blob.ForeignBlob` otherwise) and it must cover at least one token."""
    try:
        parts = parse_key(key)
    except KeyError_ as exc:
        raise BlobError(f"a blob must be stored under a store key: {exc}") from None
    blob = decode_blob(value, key=key, space_id=parts.space_id, keyring=keyring)
    if generation_of(blob.meta.space_fingerprint) != parts.generation:
        raise ForeignBlob(f"blob is from space fingerprint {blob.meta.space_fingerprint!r}, not of key generation "
                          f"{parts.generation}")
    if blob.meta.token_count <= 0:
        raise BlobError("blob covers no token")
    return blob


def verify_held(meta: BlobMeta, key_id: str, space: Space, keyring: Keyring | None) -> None:
    """The checks of :func:`verify_blob` (``trusted``) left for a blob :func:`verify_entry` passed, on its kept
    header: the reader's space generation and token bound and, with a ``keyring``, a key still held (a key
    rotated out or removed ends what it signed in memory too)."""
    if keyring is not None:  # first, as decode_blob checks it: the same blob is the same kind of miss
        if not key_id:
            raise SignatureError("blob is unsigned and this store requires signed blobs")
        check_signer(key_id, space.space_id, keyring)
    check_meta(meta, expect_space_fingerprint=space.fingerprint, max_token_count=space.chunk_size)


def blob_state(key: str, value: bytes, space: Space, keyring: Keyring | None) -> BlobState:
    """``intact``, ``foreign`` (another generation's or codec's blob: a miss, not damage), ``unknown_key`` (signed
    with a key this process does not hold, or no longer: no evidence of damage) or ``bad``."""
    try:
        verify_blob(key, value, space, keyring)
    except ForeignBlob:
        return "foreign"
    except UnknownKey:
        return "unknown_key"
    except BlobError:
        return "bad"
    return "intact"
