"""Mutation fuzzing of every parser that reads stored or transferred bytes (100,000 inputs each).

A parser either returns a value or raises its own error type; nothing else (no IndexError, no
struct.error, no garbage). Deterministic: seeded mutations of valid inputs."""

from __future__ import annotations

import json
import random

import pytest
import torch

from scd_store.codecs.scd.bundle import BundleError, parse_manifest
from scd_store.codecs.tensor_pack import PayloadError, pack, unpack
from scd_store.store.blob import BlobError, BlobMeta, Section, decode_blob, encode_blob
from scd_store.store.transfer.base import SourceInfo, TransferError, refs_from_json

INPUTS = 100_000


def mutations(seed_input: bytes, count: int, rng: random.Random):
    """Flips, overwrites, truncations, extensions, splices and random bytes around ``seed_input``."""
    n = len(seed_input)
    for i in range(count):
        data = bytearray(seed_input)
        op = i % 6
        if op == 0:
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(n)
                data[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            pos = rng.randrange(n)
            data[pos:pos + rng.randint(1, 8)] = rng.randbytes(rng.randint(1, 8))
        elif op == 2:
            data = data[:rng.randrange(n)]
        elif op == 3:
            data += rng.randbytes(rng.randint(1, 64))
        elif op == 4:
            a, b = sorted(rng.randrange(n + 1) for _ in range(2))
            data = data[:a] + data[b:] + data[a:b]
        else:
            data = bytearray(rng.randbytes(rng.randint(0, 2 * n)))
        yield bytes(data)


def fuzz(parse, error: type[Exception], seed_input: bytes, count: int = INPUTS) -> tuple[list[bytes], int]:
    """Inputs the parser accepted, and how many it refused with its own error (any other raises)."""
    rng = random.Random(1234)
    accepted: list[bytes] = []
    refused = 0
    for data in mutations(seed_input, count, rng):
        try:
            parse(data)
            accepted.append(data)
        except error:
            refused += 1
    return accepted, refused


def test_blob_parser():
    meta = BlobMeta("scd-v1", "fp" * 16, 256, ("k", "v"), ("u8",), (4,), (Section("codes", 0, 40),))
    blob = encode_blob(meta, bytes(range(200)))
    accepted, refused = fuzz(lambda d: decode_blob(d, expect_space_fingerprint="fp" * 16), BlobError, blob)
    assert len(accepted) + refused == INPUTS
    assert all(data == blob for data in accepted)  # only mutations that changed nothing pass the checksum


def test_tensor_pack_parser():
    payload = pack("scd-v1", {"start": 0, "tokens": 3}, {"codes": torch.arange(24, dtype=torch.uint8).view(3, 8),
                                                          "sinks": torch.ones(2, 3, dtype=torch.float16)})
    accepted, refused = fuzz(unpack, PayloadError, payload, count=INPUTS)
    assert len(accepted) + refused == INPUTS and refused > INPUTS // 2


def test_bundle_manifest_parser():
    manifest = json.dumps({"format": "scd-bundle", "format_version": 1, "kind": "space", "space_id": "s",
                           "layout": {"num_layers": 2, "kv_heads": 2, "head_dim": 8, "rope_theta": 1e4},
                           "sink_tokens": 4, "patch_layers": [], "content_fingerprint": "ab" * 16}).encode()
    accepted, refused = fuzz(lambda d: parse_manifest(d, "space"), BundleError, manifest)
    assert len(accepted) + refused == INPUTS and refused > INPUTS // 2


def test_transfer_info_and_refs_parsers():
    info = SourceInfo("src", "nixl", "DRAM", 1 << 40, 1 << 20, 0, b"agent-metadata" * 4).to_bytes()
    accepted, refused = fuzz(SourceInfo.from_bytes, TransferError, info)
    assert len(accepted) + refused == INPUTS
    refs = json.dumps([["k1", 0, 10], ["k2", 10, 20]]).encode()
    accepted, refused = fuzz(refs_from_json, TransferError, refs)
    assert len(accepted) + refused == INPUTS


@pytest.mark.parametrize("bad", [b"[]", b'"x"', b"null", b'{"format": "scd-bundle", "kind": "space"}',
                                 b'{"format": "scd-bundle", "kind": "space", "format_version": "1"}',
                                 b'{"format": "scd-bundle", "kind": "space", "format_version": 2}'])
def test_manifest_errors_name_the_problem(bad):
    with pytest.raises(BundleError):
        parse_manifest(bad, "space")
