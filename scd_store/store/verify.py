"""A blob read back, checked against the space generation that asked for it.

:func:`verify_blob` runs every check of :func:`~scd_store.store.blob.decode_blob` for a space (framing,
checksum, bounds, the tag when the store holds signing keys, space generation and codec);
:func:`blob_state` names what a producer's repair finds under a key readers reported.
"""

from __future__ import annotations

from typing import Literal

from scd_store.store.blob import Blob, BlobError, ForeignBlob, UnknownKey, decode_blob
from scd_store.store.records import Space
from scd_store.store.signing import Keyring

BlobState = Literal["intact", "foreign", "unknown_key", "bad"]


def verify_blob(key: str, value: bytes, space: Space, keyring: Keyring | None, *, trusted: bool = False) -> Blob:
    """Every check of a blob; ``trusted`` (this process's memory tiers, which hold only blobs it wrote
    or verified before promoting them) skips the signature's arithmetic, not the checksum, nor the check that
    its key is still held (a key rotated out or removed ends what it signed in memory too)."""
    return decode_blob(value, key=key, space_id=space.space_id, keyring=keyring, verified_before=trusted,
                       expect_space_fingerprint=space.fingerprint, max_token_count=space.chunk_size)


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
