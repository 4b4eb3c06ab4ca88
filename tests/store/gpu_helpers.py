"""A GPU tier backed by host memory, for tests only: the tier's every path (verification at entry, hits as
tensor views, eviction) runs on a CPU. Production code never builds one: :class:`GpuTier` refuses without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from scd_store.store.tiers.gpu import GpuTier

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs CUDA")


class HostGpuTier(GpuTier):
    """A :class:`GpuTier` whose blobs live in CPU tensors (test-only)."""

    @staticmethod
    def _device(torch: Any, device: str) -> torch.device:
        return torch.device("cpu")


def gpu_tiers() -> list[Any]:
    """pytest params: a host-backed GPU tier always, a real one where CUDA is present."""
    return [pytest.param(HostGpuTier, id="host"), pytest.param(GpuTier, id="cuda", marks=cuda)]


def forbid_host_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every device-to-host copy of a GPU tier's blob raise."""
    def refuse(self: GpuTier, data: torch.Tensor) -> bytes:
        raise AssertionError("a GPU tier's blob was copied to the host")

    monkeypatch.setattr(GpuTier, "_to_host", refuse)
