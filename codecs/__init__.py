"""Codecs: turn a producer's prefill state into a serialised payload and back into KV.

Installed as ``scd_store.codecs``. Imports nothing from the rest of scd-store.
"""

from scd_store.codecs.base import Codec
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.registry import CODEC_NAMES, make_codec
from scd_store.codecs.tensor_pack import PayloadError

__all__ = ["CODEC_NAMES", "Codec", "KVState", "PayloadError", "make_codec"]
