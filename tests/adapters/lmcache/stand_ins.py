"""A stand-in for a CUDA stream's copies on the CPU: :class:`DeferredCopies` (no LMCache needed)."""

from __future__ import annotations

import contextlib

import torch


class DeferredCopies:
    """Stands for a CUDA stream: a copy reads its staging when it is queued (stream order: after the decode
    that filled it, before the next one) but lands in host memory only when someone waits."""

    def __init__(self) -> None:
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.landed = self.waits = 0
        self.scopes = 0

    def copy(self, host: torch.Tensor, staging: torch.Tensor) -> None:
        self.queued.append((host, staging.clone()))

    def wait(self) -> None:
        self.waits += 1
        for host, data in self.queued:
            host.copy_(data)
        self.landed += len(self.queued)
        self.queued.clear()

    def scope(self) -> contextlib.AbstractContextManager[None]:
        self.scopes += 1
        return contextlib.nullcontext()
