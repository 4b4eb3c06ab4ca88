"""The tiered store: keys, code blobs, tiers (GPU / CPU / disk / Redis), registry, stats.

Data flows one way: this package never imports adapters, models, bench or cli.
"""

from scd_store.store.blob import BlobError, BlobMeta, decode_blob, encode_blob
from scd_store.store.keys import DEFAULT_CHUNK_SIZE, KeyError_, chunk_hashes, chunk_keys, make_key, parse_key

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "BlobError",
    "BlobMeta",
    "KeyError_",
    "chunk_hashes",
    "chunk_keys",
    "decode_blob",
    "encode_blob",
    "make_key",
    "parse_key",
]
