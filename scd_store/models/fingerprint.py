"""Content fingerprints of model weights and files (stable across processes and machines)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def tensors_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """A blake2b digest over tensor names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def file_fingerprint(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
