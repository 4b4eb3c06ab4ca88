"""The CPU tier: a byte-bounded LRU in host memory, optionally in pinned (page-locked) buffers."""

from __future__ import annotations

from collections.abc import Sequence

from scd_store.store.tiers.base import LruTier
from scd_store.store.tiers.lru import ByteLRU


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())


class CpuTier(LruTier):
    """Values kept as immutable ``bytes`` (zero-copy get), or as pinned uint8 tensors when ``pinned``
    and CUDA is present (faster host-to-device copies; get copies out)."""

    kind = "cpu"

    def __init__(self, max_bytes: int, *, pinned: bool = False, name: str | None = None) -> None:
        super().__init__(name)
        self.pinned = bool(pinned) and _cuda_available()
        self._lru: ByteLRU[object] = ByteLRU(max_bytes, self._size_of, self._evicted)
        self.max_value_bytes = max_bytes
        self.rejected_too_large = 0

    @staticmethod
    def _size_of(value: object) -> int:
        return value.nbytes if hasattr(value, "nbytes") else len(value)  # type: ignore[arg-type]

    def _to_store(self, value: bytes) -> object:
        if not self.pinned:
            return bytes(value)
        import torch

        tensor = torch.empty(len(value), dtype=torch.uint8, pin_memory=True)
        tensor.numpy()[:] = memoryview(value)
        return tensor

    @staticmethod
    def _from_store(value: object | None) -> bytes | None:
        if value is None or isinstance(value, bytes):
            return value  # type: ignore[return-value]
        return value.numpy().tobytes()  # type: ignore[attr-defined]

    def get_now(self, key: str) -> bytes | None:
        return self._from_store(self._lru.get(key))

    def get_many_now(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._from_store(v) for v in self._lru.get_many(keys)]

    def put_now(self, key: str, value: bytes) -> None:
        if not self._lru.put(key, self._to_store(value)):
            self.rejected_too_large += 1
