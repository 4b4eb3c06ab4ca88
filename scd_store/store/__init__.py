"""The tiered store: bytes by key. Chunk keys, code blobs, tiers (GPU / CPU / disk / Redis), the
read path, the write-behind, producer / consumer views, registry, stats and transfer.

It knows no codec: payloads are opaque bytes. Only the layers above it import it: service, models,
adapters, bench and cli (the import-linter contract in pyproject.toml).
"""

from scd_store.store.blob import BlobError, BlobMeta, decode_blob, encode_blob
from scd_store.store.keys import DEFAULT_CHUNK_SIZE, KeyError_, chunk_hashes, hash_keys, make_key, parse_key

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "BlobError",
    "BlobMeta",
    "KeyError_",
    "chunk_hashes",
    "hash_keys",
    "decode_blob",
    "encode_blob",
    "make_key",
    "parse_key",
]
