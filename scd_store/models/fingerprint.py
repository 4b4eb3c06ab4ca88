"""Content fingerprints of model weights and files (stable across processes and machines)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from scd_store.codecs.fingerprint import tensors_fingerprint

__all__ = ["file_fingerprint", "tensors_fingerprint"]


def file_fingerprint(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
