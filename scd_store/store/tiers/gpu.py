"""The GPU tier: a byte-bounded LRU of CUDA uint8 tensors. Only built when CUDA is present."""

from __future__ import annotations

from collections.abc import Sequence

from scd_store.store.tiers.base import LruTier, TierError
from scd_store.store.tiers.lru import ByteLRU


class GpuTier(LruTier):
    """Keeps blobs in device memory so a consumer on the same device decodes without a host copy.

    ``get`` returns bytes (a device-to-host copy); :meth:`get_tensor` returns the device tensor itself.
    """

    kind = "gpu"

    def __init__(self, max_bytes: int, *, device: str = "cuda", name: str | None = None) -> None:
        import torch

        if not torch.cuda.is_available():
            raise TierError("the GPU tier needs CUDA, and torch.cuda.is_available() is False")
        super().__init__(name)
        self._torch = torch
        self.device = torch.device(device)
        self._lru: ByteLRU[object] = ByteLRU(max_bytes, lambda t: t.numel(), self._evicted)
        self.max_value_bytes = max_bytes

    def get_tensor(self, key: str):  # noqa: ANN201 - torch.Tensor | None
        return self._lru.get(key)

    def get_now(self, key: str) -> bytes | None:
        tensor = self._lru.get(key)
        return None if tensor is None else tensor.cpu().numpy().tobytes()

    def get_many_now(self, keys: Sequence[str]) -> list[bytes | None]:
        return [None if t is None else t.cpu().numpy().tobytes() for t in self._lru.get_many(keys)]

    def put_now(self, key: str, value: bytes) -> None:
        torch = self._torch
        host = torch.frombuffer(bytearray(value), dtype=torch.uint8)
        self._lru.put(key, host.to(self.device, non_blocking=False))
