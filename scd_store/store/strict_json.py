"""JSON another process wrote (blob headers, registry records, transfer data, counters): ``NaN``, ``Infinity``
and numbers overflowing a float (``1e400``) are refused with ``ValueError``, like any malformed JSON; deep
nesting raises ``RecursionError``."""

from __future__ import annotations

import json
import math
from typing import Any


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number stored data may hold")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} overflows a float")
    return value


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads`` with non-finite numbers refused."""
    return json.loads(data, parse_constant=_no_constant, parse_float=_finite)
