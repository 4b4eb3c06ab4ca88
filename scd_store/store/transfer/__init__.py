"""Moving code blobs between processes: a producer's :class:`BlobSource` publishes blobs in registered
memory; a consumer's :class:`BlobReader` reads many of them in one batched transfer.

NIXL (UCX; DRAM, or VRAM where CUDA is present) when it is installed, else an in-process copy.
"""

from scd_store.store.transfer.base import BlobReader, BlobRef, BlobSource, SourceInfo, TransferError
from scd_store.store.transfer.factory import make_reader, make_source, nixl_available

__all__ = ["BlobReader", "BlobRef", "BlobSource", "SourceInfo", "TransferError", "make_reader", "make_source",
           "nixl_available"]
