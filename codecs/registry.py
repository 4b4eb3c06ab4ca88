"""Codecs by name."""

from __future__ import annotations

import torch

from scd_store.codecs.base import Codec
from scd_store.codecs.baselines import KiviCodec, RawCodec
from scd_store.codecs.rotated import RotatedCodec

CODEC_NAMES = ("raw", "raw-bf16", "int8", "int4", "int2", "rot1", "rot2", "rot3", "rot4")


def make_codec(name: str) -> Codec:
    """Build a baseline codec by name (``raw``, ``raw-bf16``, ``int8``, ``int4``, ``int2``,
    ``rot1`` .. ``rot4``: :mod:`~scd_store.codecs.rotated`)."""
    if name == "raw":
        return RawCodec(torch.float16)
    if name == "raw-bf16":
        return RawCodec(torch.bfloat16)
    if name in ("int8", "int4", "int2"):
        return KiviCodec(int(name[3:]))
    if name in ("rot1", "rot2", "rot3", "rot4"):
        return RotatedCodec(int(name[3:]))
    raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}")
