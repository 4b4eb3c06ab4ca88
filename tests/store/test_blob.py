from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scd_store.store.blob import MAGIC, BlobError, BlobMeta, decode_blob, encode_blob

META = BlobMeta("scd-reuse", "fp-1", 256)
PAYLOAD = bytes(range(32))


def test_round_trip() -> None:
    blob = decode_blob(encode_blob(META, PAYLOAD), expect_space_fingerprint="fp-1", expect_codec_id="scd-reuse")
    assert blob.meta == META
    assert bytes(blob.payload) == PAYLOAD


def test_every_flipped_byte_is_detected() -> None:
    data = encode_blob(META, PAYLOAD)
    for i in range(len(data)):
        for mask in (0x01, 0x80):
            bad = bytearray(data)
            bad[i] ^= mask
            with pytest.raises(BlobError):
                decode_blob(bytes(bad))


def test_every_truncation_and_extension_is_detected() -> None:
    data = encode_blob(META, PAYLOAD)
    for n in range(len(data)):
        with pytest.raises(BlobError):
            decode_blob(data[:n])
    for extra in (b"\0", b"x" * 7, data):
        with pytest.raises(BlobError):
            decode_blob(data + extra)


def test_wrong_fingerprint_or_codec() -> None:
    data = encode_blob(META, PAYLOAD)
    with pytest.raises(BlobError, match="fingerprint"):
        decode_blob(data, expect_space_fingerprint="fp-2")
    with pytest.raises(BlobError, match="codec"):
        decode_blob(data, expect_codec_id="int4")


def _with_header(header: bytes) -> bytes:
    """A well-framed, checksummed blob around ``header`` (what a writer of a tier could make)."""
    import struct

    import xxhash

    body = struct.pack("<4sHHIQ", MAGIC, 3, 0, len(header), len(PAYLOAD)) + header + PAYLOAD
    return body + xxhash.xxh3_128(body).digest()


@pytest.mark.parametrize("count", [b"Infinity", b"-Infinity", b"NaN", b"1e400", b"2.5", b"true", b'"256"'])
def test_headers_with_numbers_that_are_no_token_count_are_refused(count: bytes) -> None:
    header = b'{"codec_id":"c","space_fingerprint":"f","token_count":' + count + b"}"
    with pytest.raises(BlobError):  # never an OverflowError or a float through to a decoder
        decode_blob(_with_header(header), max_token_count=256)


@pytest.mark.parametrize("kwargs", [dict(codec_id=""), dict(space_fingerprint=""), dict(token_count=-1),
                                    dict(token_count=1.0), dict(token_count=True)])
def test_bad_meta(kwargs) -> None:
    base = dict(codec_id="c", space_fingerprint="f", token_count=1)
    with pytest.raises(BlobError):
        BlobMeta(**{**base, **kwargs})


@settings(max_examples=60, deadline=None)
@given(payload=st.binary(max_size=512), positions=st.lists(st.integers(min_value=0), min_size=1, max_size=4),
       values=st.binary(min_size=4, max_size=4))
def test_random_corruption_detected(payload: bytes, positions: list[int], values: bytes) -> None:
    data = encode_blob(BlobMeta("c", "f", 256), payload)
    bad = bytearray(data)
    for pos, value in zip(positions, values, strict=False):
        bad[pos % len(bad)] = value
    if bytes(bad) == data:
        assert bytes(decode_blob(bytes(bad)).payload) == payload
    else:
        with pytest.raises(BlobError):
            decode_blob(bytes(bad))
