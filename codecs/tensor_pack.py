"""A self-describing, pickle-free container for named tensors.

Layout (little-endian)::

    b"SCDP" | u16 version | u32 header length | header JSON (utf-8) | pad to 16 | tensor bytes...

The JSON header holds the codec id, codec metadata and, per tensor, its dtype, shape, byte
offset (from the start of the data section) and byte length. Each tensor starts 16-byte aligned.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, NoReturn

import torch

from scd_store.errors import ScdStoreError

MAGIC = b"SCDP"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
_ALIGN = 16
_HEAD_PROBE = 4096  # bytes read first to find the header (one copy for a device payload)
_MAX_DIMS = 8  # the most dimensions a tensor entry may declare (KIVI codes have 5)
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class PayloadError(ScdStoreError, ValueError):
    """A payload is malformed, truncated, of another version or of another codec."""


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"JSON constant {name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"JSON number {text[:40]} overflows a float")
    return value


def strict_json(data: str | bytes) -> Any:
    """``json.loads`` that refuses ``NaN`` / ``Infinity`` and numbers overflowing a float (``1e400``) with
    ``ValueError``; deep nesting raises ``RecursionError``. For JSON another process wrote."""
    return json.loads(data, parse_constant=_no_constant, parse_float=_finite_float)


def json_int(value: object, what: str, error: type[Exception] = PayloadError) -> int:
    """``value`` when it is a JSON integer (not a bool, float or string), else ``error``: no coercion."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{what} must be an integer, got {value!r:.40}")
    return value


def json_number(value: object, what: str, error: type[Exception] = PayloadError) -> float:
    """``value`` as a float when it is a finite JSON number (an integer or a float, not a bool), else ``error``."""
    try:
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer past the float range
        number = math.nan
    if not math.isfinite(number):
        raise error(f"{what} must be a finite number, got {value!r:.40}")
    return number


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def pack(codec_id: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
    """Serialise named tensors with codec metadata into one byte string."""
    entries, blobs, offset = [], [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r}: unsupported dtype {tensor.dtype}")
        data = tensor.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        entries.append({"name": name, "dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "offset": offset, "nbytes": len(data)})
        blobs.append(data + b"\0" * _pad(len(data)))
        offset += len(data) + _pad(len(data))
    header = json.dumps({"codec": codec_id, "meta": meta, "tensors": entries}, separators=(",", ":"),
                        allow_nan=False).encode()  # what unpack reads back: no NaN / Infinity
    prefix = _PREFIX.pack(MAGIC, VERSION, len(header))
    head = prefix + header
    return head + b"\0" * _pad(len(head)) + b"".join(blobs)


def _read_head(payload: bytes | bytearray | memoryview | torch.Tensor, size: int) -> memoryview:
    """The first ``size`` bytes of ``payload`` on the host (one small device-to-host copy for a tensor)."""
    if isinstance(payload, torch.Tensor):
        return memoryview(payload[:size].cpu().numpy().tobytes())
    return memoryview(payload)[:size]


def _as_uint8(payload: torch.Tensor) -> torch.Tensor:
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise PayloadError("a tensor payload must be a contiguous 1-D uint8 tensor")
    return payload


def unpack(payload: bytes | bytearray | memoryview | torch.Tensor, codec_id: str | None = None
           ) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """Parse a payload. Byte payloads give CPU tensors; a uint8 tensor payload (a GPU tier's blob,
    say) gives views into it on its device, without a copy. Raises :class:`PayloadError` on any defect."""
    is_tensor = isinstance(payload, torch.Tensor)
    total = _as_uint8(payload).numel() if is_tensor else len(memoryview(payload))
    if total < _PREFIX.size:
        raise PayloadError(f"payload too short ({total} bytes)")
    head = _read_head(payload, min(total, _HEAD_PROBE))
    magic, version, header_len = _PREFIX.unpack_from(head, 0)
    if magic != MAGIC:
        raise PayloadError("bad magic: not a scd-store tensor pack")
    if version != VERSION:
        raise PayloadError(f"tensor pack version {version} not supported (expected {VERSION})")
    head_end = _PREFIX.size + header_len
    if head_end > total:
        raise PayloadError("truncated header")
    if head_end > len(head):
        head = _read_head(payload, head_end)
    try:
        header = strict_json(bytes(head[_PREFIX.size:head_end]))
        found_codec, meta, entries = header["codec"], header["meta"], header["tensors"]
    except (ValueError, KeyError, TypeError, RecursionError, OverflowError) as exc:
        raise PayloadError(f"malformed header: {exc}") from None
    if not isinstance(found_codec, str) or not isinstance(meta, dict) or not isinstance(entries, list):
        raise PayloadError("malformed header: codec must be a string, meta an object, tensors a list")
    if codec_id is not None and found_codec != codec_id:
        raise PayloadError(f"payload is codec {found_codec!r}, expected {codec_id!r}")
    base = head_end + _pad(head_end)
    tensors = {}
    end = base
    for entry in entries:
        try:
            name, dtype, shape = entry["name"], _DTYPES[entry["dtype"]], entry["shape"]
            if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
                raise PayloadError(f"a tensor shape must be a list of at most {_MAX_DIMS} integers")
            shape = [json_int(s, "a tensor dimension") for s in shape]
            start = base + json_int(entry["offset"], "a tensor offset")
            nbytes = json_int(entry["nbytes"], "a tensor's byte count")
        except PayloadError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PayloadError(f"malformed tensor entry: {exc}") from None
        if not isinstance(name, str) or name in tensors:
            raise PayloadError(f"tensor names must be distinct strings, got {name!r}")
        count = 1
        for s in shape:
            count *= s
        if min(shape, default=1) < 0 or nbytes < 0 or nbytes != count * dtype.itemsize or start < end \
                or start + nbytes > total:
            raise PayloadError(f"tensor {name!r}: size or bounds do not match its header")
        if is_tensor:
            raw = payload[start:start + nbytes]
            if raw.storage_offset() % dtype.itemsize:
                raw = raw.clone()
        elif nbytes:
            raw = torch.frombuffer(bytearray(memoryview(payload)[start:start + nbytes]), dtype=torch.uint8)
        else:
            raw = torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(shape)
        end = max(end, start + nbytes + _pad(nbytes))
    if total != end:
        raise PayloadError(f"payload is {total} bytes, its header describes {end}")
    return found_codec, meta, tensors
