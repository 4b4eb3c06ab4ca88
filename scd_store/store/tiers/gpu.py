"""The GPU tier: a byte-bounded LRU of blobs kept as uint8 tensors in this process's device memory.

Only this process writes it (its producer's puts, and promotions of blobs the read path verified), and every
blob is verified as it enters (:func:`~scd_store.store.verify.verify_entry`: framing, checksum, header, the
signature for its key when the store holds signing keys, the key's generation): one that fails never enters
and is counted as the read path counts it (``corrupt_blobs``, ``bad_signatures`` or ``foreign_blobs``, under
this tier and the key's space; the first of each kind logged). Its parsed header stays on the host beside the
tensor (:class:`DeviceBlob`), so a hit hands the decode the verified header and a tensor view of the payload,
with no device-to-host copy (:meth:`GpuTier.get_blobs_now`); the read path checks the kept header against the
reader's space (:func:`~scd_store.store.verify.verify_held`). ``get_now`` still returns bytes (a copy out),
for promotions to a tier below it and the write-behind's re-sync.

A payload handed to a reader (:meth:`GpuTier.lend`, :meth:`GpuTier.get_tensor`) is recorded on the reader's current
CUDA stream (:func:`keep_for_stream`): an eviction drops the tier's reference at once, but PyTorch's caching
allocator reuses the memory (a re-upload on the putting thread's stream) only once the work the reader's stream had
queued when the last reference went (a decode still reading it) has run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scd_store.store.blob import BlobError, BlobMeta, ForeignBlob, SignatureError
from scd_store.store.keys import space_of
from scd_store.store.tiers.base import LruTier, TierError
from scd_store.store.tiers.lru import ByteLRU
from scd_store.store.verify import verify_entry

if TYPE_CHECKING:
    import torch

log = logging.getLogger("scd_store.store")


def keep_for_stream(tensor: torch.Tensor, stream: Any = None) -> None:
    """Keep ``tensor``'s device memory from reuse until the work queued on ``stream`` (default: the calling
    thread's current stream on the tensor's device) by the time the memory is freed has run: PyTorch's
    ``record_stream``, for a tensor (or a view of one) read on another stream than the one that allocated it.
    Nothing off CUDA."""
    if tensor.device.type != "cuda":
        return
    import torch

    tensor.record_stream(stream if stream is not None else torch.cuda.current_stream(tensor.device))


@dataclass(frozen=True, slots=True)
class DeviceBlob:
    """A blob the GPU tier verified as it took it in: its header on the host, its bytes on the device.

    ``key_id``: the key whose signature was checked ("" when the store holds no keyring). ``payload`` is a
    view of ``data`` (no copy); readers must not write into it."""

    meta: BlobMeta
    key_id: str
    data: torch.Tensor
    payload_offset: int
    payload_len: int

    @property
    def payload(self) -> torch.Tensor:
        """The codec payload: a contiguous 1-D uint8 view of :attr:`data` on the tier's device."""
        return self.data[self.payload_offset:self.payload_offset + self.payload_len]

    @property
    def nbytes(self) -> int:
        """The whole blob's size in bytes (what the tier's bound counts)."""
        return int(self.data.numel())


class GpuTier(LruTier):
    """Keeps verified blobs in device memory, so a consumer decodes a hit without a host copy.

    ``get_blobs_now`` returns :class:`DeviceBlob` entries (header on the host, tensor on the device);
    ``get_now`` returns bytes (a device-to-host copy); :meth:`get_tensor` returns a blob's whole tensor."""

    kind = "gpu"

    def __init__(self, max_bytes: int, *, device: str = "cuda", name: str | None = None) -> None:
        import torch

        super().__init__(name)
        self._torch = torch
        self.device = self._device(torch, device)
        self._lru: ByteLRU[DeviceBlob] = ByteLRU(max_bytes, lambda b: b.nbytes, self._evicted)
        self.max_value_bytes = max_bytes
        self.rejected_too_large = 0
        self._refusals = self._incidents(log)

    @staticmethod
    def _device(torch: Any, device: str) -> torch.device:
        """The CUDA device the tier keeps blobs on; a :class:`TierError` without CUDA or for another device.
        (Tests override this to back the tier with host memory: never a configuration.)"""
        if not torch.cuda.is_available():
            raise TierError("the GPU tier needs CUDA, and torch.cuda.is_available() is False")
        resolved = torch.device(device)
        if resolved.type != "cuda":
            raise TierError(f"the GPU tier keeps blobs on a CUDA device, not {device!r}")
        return resolved if resolved.index is not None else torch.device("cuda", torch.cuda.current_device())

    # ----------------------------------------------------------------- reads
    def get_blobs_now(self, keys: Sequence[str]) -> list[DeviceBlob | None]:
        """The verified entries of ``keys`` (None where absent), most recently used now; nothing is copied.
        A reader takes a payload through :meth:`lend`."""
        return self._lru.get_many(keys)

    def lend(self, blob: DeviceBlob) -> torch.Tensor:
        """``blob``'s payload for a reader on the calling thread, its memory kept from reuse (after an eviction)
        until the work the reader's current stream queues on it has run (:func:`keep_for_stream`)."""
        payload = blob.payload
        self._keep(payload)
        return payload

    def get_tensor(self, key: str) -> torch.Tensor | None:
        """A blob's whole tensor on the device (header and trailer included), or None; kept as :meth:`lend`."""
        entry = self._lru.get(key)
        if entry is None:
            return None
        self._keep(entry.data)
        return entry.data

    def _keep(self, tensor: torch.Tensor) -> None:
        """Record ``tensor`` on the calling thread's current stream (tests override it to watch)."""
        keep_for_stream(tensor)

    def get_now(self, key: str) -> bytes | None:
        entry = self._lru.get(key)
        return None if entry is None else self._to_host(entry.data)

    def get_many_now(self, keys: Sequence[str]) -> list[bytes | None]:
        return [None if e is None else self._to_host(e.data) for e in self._lru.get_many(keys)]

    def _to_host(self, data: torch.Tensor) -> bytes:
        """A blob's bytes on the host: the tier's only device-to-host copy."""
        return data.cpu().numpy().tobytes()

    # ----------------------------------------------------------------- writes: verified on the way in
    def put_now(self, key: str, value: bytes) -> None:
        """Verify ``value`` under ``key`` and keep it on the device; a blob that fails never enters (counted)."""
        try:
            blob = verify_entry(key, value, self.keyring)
        except BlobError as exc:
            self._refuse(key, exc)
            return
        torch = self._torch
        host = torch.frombuffer(bytearray(value), dtype=torch.uint8)
        entry = DeviceBlob(blob.meta, blob.key_id, host.to(self.device, non_blocking=False), blob.payload_offset,
                           blob.payload.nbytes)
        if not self._lru.put(key, entry):
            self.rejected_too_large += 1

    def _refuse(self, key: str, exc: BlobError) -> None:
        """Count a blob refused at entry as the read path counts a bad one; log the first of each kind."""
        kind = ("foreign_blobs" if isinstance(exc, ForeignBlob) else
                "bad_signatures" if isinstance(exc, SignatureError) else "corrupt_blobs")
        self._refusals.count(kind, "gpu tier %s: refused a blob under %s (%s: %s): it never enters this tier; "
                             "further ones are counted (%s), not logged", self.name, key, type(exc).__name__, exc,
                             kind, once=kind, space=space_of(key))
