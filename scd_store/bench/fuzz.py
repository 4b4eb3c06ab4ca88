"""Mutation fuzzing of every parser of stored or transferred bytes (used by the tests and ``bench soak``).

Seeded mutations of valid inputs (bit flips, overwrites, truncations, extensions, splices, random
bytes). A parser either returns or raises its own documented error type; anything else is a crash.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

import torch

from scd_store.codecs.scd.bundle import BundleError, parse_manifest
from scd_store.codecs.tensor_pack import PayloadError, pack, unpack
from scd_store.store.blob import BlobError, BlobMeta, decode_blob, encode_blob
from scd_store.store.transfer.base import SourceInfo, TransferError, refs_from_json

BLOB_FINGERPRINT = "fp" * 16


def mutations(seed_input: bytes, count: int, rng: random.Random) -> Iterator[bytes]:
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


def fuzz(parse: Callable[[bytes], object], error: type[Exception], seed_input: bytes, count: int,
         seed: int = 1234) -> tuple[list[bytes], int]:
    """Inputs the parser accepted, and how many it refused with ``error``; any other exception propagates."""
    rng = random.Random(seed)
    accepted: list[bytes] = []
    refused = 0
    for data in mutations(seed_input, count, rng):
        try:
            parse(data)
            accepted.append(data)
        except error:
            refused += 1
    return accepted, refused


def seed_blob() -> bytes:
    meta = BlobMeta("scd-v1", BLOB_FINGERPRINT, 256)
    return encode_blob(meta, bytes(range(200)))


def seed_payload() -> bytes:
    return pack("scd-v1", {"start": 0, "tokens": 3}, {"codes": torch.arange(24, dtype=torch.uint8).view(3, 8),
                                                       "sinks": torch.ones(2, 3, dtype=torch.float16)})


def seed_manifest() -> bytes:
    return json.dumps({"format": "scd-bundle", "format_version": 1, "kind": "space", "space_id": "s",
                       "layout": {"num_layers": 2, "kv_heads": 2, "head_dim": 8, "rope_theta": 1e4},
                       "sink_tokens": 4, "patch_layers": [], "content_fingerprint": "ab" * 16}).encode()


TARGETS: dict[str, tuple[Callable[[bytes], object], type[Exception], Callable[[], bytes]]] = {
    "blob": (lambda d: decode_blob(d, expect_space_fingerprint=BLOB_FINGERPRINT), BlobError, seed_blob),
    "tensor_pack": (unpack, PayloadError, seed_payload),
    "bundle_manifest": (lambda d: parse_manifest(d, "space"), BundleError, seed_manifest),
    "transfer_info": (SourceInfo.from_bytes, TransferError,
                      lambda: SourceInfo("src", "nixl", "DRAM", 1 << 40, 1 << 20, 0, b"agent-md" * 8).to_bytes()),
    "transfer_refs": (refs_from_json, TransferError, lambda: json.dumps([["k1", 0, 10], ["k2", 10, 20]]).encode()),
}


def fuzz_all(count: int = 100_000) -> dict[str, dict[str, int]]:
    """Fuzz every target with ``count`` inputs; per target: inputs, accepted, refused, crashes (always 0:
    a crash raises). For blobs, ``accepted_changed`` counts accepted inputs that differ from the seed."""
    report = {}
    for name, (parse, error, make_seed) in TARGETS.items():
        seed_input = make_seed()
        accepted, refused = fuzz(parse, error, seed_input, count)
        report[name] = {"inputs": count, "accepted": len(accepted), "refused": refused, "crashes": 0,
                        "accepted_changed": sum(a != seed_input for a in accepted)}
    return report
