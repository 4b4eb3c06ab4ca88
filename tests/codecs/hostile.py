"""Hostile JSON numbers written into tensor-pack headers and manifests (for the parser tests)."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

_PREFIX = struct.Struct("<4sHI")
_SENTINEL = "@@hostile-number@@"
# what another process may write where a number belongs: none of it may crash a parser or be coerced
HOSTILE = ("Infinity", "-Infinity", "NaN", "1e400", "-1e400", "2.5", "true", "false", '"7"', "null", "[1]",
           "{}", "1" * 5000)


def hostile_variants(value: Any) -> list[str]:
    """:data:`HOSTILE`, plus the field's own value as a float (``8.0``): what ``int()`` would silently accept."""
    return [*HOSTILE, f"{value}.0"] if isinstance(value, int) and not isinstance(value, bool) else list(HOSTILE)


def _set(obj: Any, path: Sequence[str | int], value: Any) -> Any:
    old = obj
    for step in path[:-1]:
        old = old[step]
    before, old[path[-1]] = old[path[-1]], value
    return before


def with_json_field(obj: Any, path: Sequence[str | int], token: str) -> tuple[str, Any]:
    """``obj`` as JSON text with the value at ``path`` replaced by the raw JSON ``token``; and the old value."""
    obj = json.loads(json.dumps(obj))
    before = _set(obj, path, _SENTINEL)
    return json.dumps(obj, separators=(",", ":")).replace(json.dumps(_SENTINEL), token), before


def pack_header(payload: bytes) -> dict:
    """The parsed JSON header of a tensor pack."""
    _, _, length = _PREFIX.unpack_from(payload, 0)
    return json.loads(payload[_PREFIX.size:_PREFIX.size + length])


def with_pack_field(payload: bytes, path: Sequence[str | int], token: str) -> bytes:
    """A tensor pack with one header value replaced by the raw JSON ``token`` (prefix and padding redone,
    so the container's framing stays valid and the parser has to judge the value itself)."""
    magic, version, length = _PREFIX.unpack_from(payload, 0)
    end = _PREFIX.size + length
    data = payload[end + (-end) % 16:]
    text, _ = with_json_field(json.loads(payload[_PREFIX.size:end]), path, token)
    header = text.encode()
    head = _PREFIX.pack(magic, version, len(header)) + header
    return head + b"\0" * ((-len(head)) % 16) + data
