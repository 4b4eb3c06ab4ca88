"""What a read of the store returns: :class:`CodeChunk` (one verified chunk of a get) and :class:`PrefixHit`
(a lookup's answer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from scd_store.store.blob import BlobMeta

if TYPE_CHECKING:
    import torch

# a chunk's codec payload: a host view of the blob's bytes, or (a GPU tier's hit) a 1-D uint8 tensor view of the
# blob's tensor on its device; codecs take either (tensor_pack.unpack)
Payload = Union[memoryview, "torch.Tensor"]


@dataclass(frozen=True, slots=True)
class CodeChunk:
    """One verified chunk out of the store: its key, position, tokens covered, codec payload and header, and the
    tier that served it. ``payload`` is a ``memoryview`` of host bytes, or a contiguous 1-D uint8 ``torch.Tensor``
    on the device of the GPU tier that held it (no device-to-host copy: :attr:`on_device`)."""

    key: str
    index: int
    token_count: int
    payload: Payload
    meta: BlobMeta
    tier: str

    @property
    def on_device(self) -> bool:
        """Whether :attr:`payload` is a tensor (a GPU tier's hit) rather than host bytes."""
        return not isinstance(self.payload, memoryview)

    @property
    def nbytes(self) -> int:
        """The payload's size in bytes (either kind)."""
        return int(self.payload.nbytes)

    def host_payload(self) -> memoryview:
        """The payload as host bytes: itself, or one device-to-host copy of a tensor payload (for tools and
        checks; a decode takes the tensor as it is)."""
        if isinstance(self.payload, memoryview):
            return self.payload
        return memoryview(self.payload.detach().cpu().numpy()).cast("B").toreadonly()


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A lookup's answer: the leading run of chunks present, which tier holds each of them, and how many of
    them only a remote tier (Redis, a peer) holds (a get of those waits on the network)."""

    hit_chunks: int
    total_chunks: int
    tiers: tuple[str, ...]
    remote_chunks: int = 0
