"""Content fingerprints of named tensors (stable across processes and machines)."""

from __future__ import annotations

import hashlib

import torch


def tensors_fingerprint(state: dict[str, torch.Tensor], extra: str = "") -> str:
    """A blake2b digest over tensor names, dtypes, shapes and bytes (in name order) and ``extra``."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(extra.encode())
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
