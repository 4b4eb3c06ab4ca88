"""Model material kept compactly in the tree: safetensors files packed losslessly (``*.safetensors.packed``).

A packed file is :data:`MAGIC` (8 bytes), the SHA-256 of the original safetensors file (32 bytes), then one zlib
stream of that file with each tensor's bytes split into byte planes (the first byte of every element, then the
second, ...; the header and 1-byte tensors stay as they are). Unpacking gives the original file back byte for
byte, checked against its SHA-256, so its tensors load bit-identical. Byte planes let zlib find the redundancy of
floats: the sign / exponent bytes of the kept bundle's fp32 and bf16 tensors repeat a lot, their low mantissa
bytes are noise; the adapters' per-row int8 deltas hold about 7.35 bits per value and gain only ~7%. Nothing is
pickled: the payload is a safetensors file.

Pack a file (or every ``*.safetensors`` under a directory) in place, e.g. a freshly calibrated bundle::

    python -m scd_store.models.packed scd_store/models/bundles/catalog
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load, load_file, save

from scd_store.errors import ScdStoreError

MAGIC = b"SCDPACK1"
SUFFIX = ".packed"
_HEAD = len(MAGIC) + 32
# element sizes of the safetensors dtypes; a dtype not named here keeps its bytes in order (1)
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


class PackError(ScdStoreError, ValueError):
    """A packed file is corrupt, truncated, or not a packed safetensors file."""


def is_packed(path: Path) -> bool:
    return Path(path).name.endswith(SUFFIX)


def _planes(data: bytes, *, inverse: bool) -> bytes:
    """Split each tensor's bytes into byte planes (or, ``inverse``, join them back): a permutation of ``data``
    given by its own safetensors header, which it leaves in place."""
    if len(data) < 8:
        raise PackError("not a safetensors file: shorter than its header length")
    (header_len,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + header_len])
        regions = [(8 + header_len + entry["data_offsets"][0], 8 + header_len + entry["data_offsets"][1],
                    _ITEMSIZE.get(entry["dtype"], 1)) for name, entry in header.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise PackError(f"not a safetensors header: {exc}") from None
    out = bytearray(data)
    for begin, end, size in regions:
        if size == 1 or end <= begin or (end - begin) % size or end > len(data):
            continue
        block = np.frombuffer(data, dtype=np.uint8, count=end - begin, offset=begin)
        out[begin:end] = (block.reshape(size, -1).T if inverse else block.reshape(-1, size).T).tobytes()
    return bytes(out)


def pack(data: bytes) -> bytes:
    """The packed form of the safetensors file ``data`` (which must load)."""
    try:
        load(data)
    except Exception as exc:  # safetensors raises its own error class, or ValueError / OSError
        raise PackError(f"not a loadable safetensors file: {exc}") from None
    return MAGIC + hashlib.sha256(data).digest() + zlib.compress(_planes(data, inverse=False), 9)


def unpack(blob: bytes) -> bytes:
    """The original safetensors file of a packed one, byte for byte."""
    if len(blob) < _HEAD or not blob.startswith(MAGIC):
        raise PackError("not a packed safetensors file (bad magic)")
    try:
        data = _planes(zlib.decompress(blob[_HEAD:]), inverse=True)
    except zlib.error as exc:
        raise PackError(f"corrupt packed file: {exc}") from None
    if hashlib.sha256(data).digest() != blob[len(MAGIC) : _HEAD]:
        raise PackError("corrupt packed file: the unpacked bytes do not match their SHA-256")
    return data


def original_sha256(path: Path) -> str:
    """The SHA-256 (hex) of the safetensors file ``path`` holds: read from a packed file's head, else hashed."""
    path = Path(path)
    if not is_packed(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()
    with open(path, "rb") as handle:
        head = handle.read(_HEAD)
    if len(head) < _HEAD or not head.startswith(MAGIC):
        raise PackError(f"{path}: not a packed safetensors file (bad magic)")
    return head[len(MAGIC) :].hex()


def read_bytes(path: Path) -> bytes:
    """The safetensors file at ``path``, unpacked when it is packed (``*.packed``)."""
    path = Path(path)
    blob = path.read_bytes()
    if not is_packed(path):
        return blob
    try:
        return unpack(blob)
    except PackError as exc:
        raise PackError(f"{path}: {exc}") from None


def content_fingerprint(path: Path) -> str:
    """blake2b-128 of the (unpacked) safetensors file: the same value for a file and its packed form."""
    return hashlib.blake2b(read_bytes(path), digest_size=16).hexdigest()


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, packed or not."""
    path = Path(path)
    return load(read_bytes(path)) if is_packed(path) else load_file(str(path))


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as a safetensors file, packed when ``path`` ends in :data:`SUFFIX`."""
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    Path(path).write_bytes(pack(data) if is_packed(Path(path)) else data)


def pack_file(path: Path, *, remove: bool = True) -> Path:
    """Pack ``path`` (a ``*.safetensors`` file) next to it as ``<path>.packed``, checked by unpacking it back;
    ``remove`` deletes the original afterwards."""
    path = Path(path)
    data = path.read_bytes()
    blob = pack(data)
    if unpack(blob) != data:  # never expected: pack and unpack are exact inverses
        raise PackError(f"{path}: packing does not round-trip")
    out = path.with_name(path.name + SUFFIX)
    out.write_bytes(blob)
    if remove:
        path.unlink()
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m scd_store.models.packed FILE.safetensors|DIR ...", file=sys.stderr)
        return 2
    for arg in argv:
        root = Path(arg)
        for path in sorted(root.rglob("*.safetensors")) if root.is_dir() else [root]:
            before = path.stat().st_size
            out = pack_file(path)
            print(f"{out}: {before} -> {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
