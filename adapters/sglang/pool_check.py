"""Which SGLang host pools the backend can serve: :func:`check_host_pool`, run when SGLang registers its pool.

scd-store reads a page as float values and writes decoded float KV back, so a pool must hold plain 16- or
32-bit floats, one per element. SGLang's quantised KV caches do not: ``--kv-cache-dtype fp8_e4m3`` /
``fp8_e5m2`` pools store the fp8 bytes as ``torch.uint8``, ``mxfp8`` pools ``torch.float8_e4m3fn`` with
per-block scales beside them, ``nvfp4`` / ``fp4_mx_block16`` packed 4-bit bytes. Reading such a page as
values, or casting decoded KV into it, gives garbage, so such a pool is refused at start, never served.
"""

from __future__ import annotations

from typing import Any

import torch

from scd_store.adapters.sglang.pages import LAYOUTS
from scd_store.service import SettingsError

WRITABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FIX = ("start SGLang with --kv-cache-dtype bf16 (or auto, where the model's checkpoint does not ask for an "
       "fp8 KV cache) so its host pool holds the model's float KV")


def check_host_pool(pool: Any) -> None:
    """Raise :class:`SettingsError` unless ``pool`` is an MHA pool of a supported layout holding plain float KV
    (fp16, bf16 or fp32, no scales, K and V of one head size)."""
    layout = getattr(pool, "layout", None)
    if layout not in LAYOUTS:
        raise SettingsError(f"host pool layout {layout!r} is not supported (supported: {LAYOUTS})")
    dtype = getattr(pool, "dtype", None)
    if dtype not in WRITABLE_DTYPES:
        raise SettingsError(f"host pool dtype {dtype} is not one scd-store can read and write exactly (it needs one "
                            f"of {', '.join(str(d) for d in WRITABLE_DTYPES)}; SGLang's fp8 pools hold uint8 bytes, "
                            f"mxfp8 float8_e4m3fn with block scales, fp4 packed bytes): {FIX}")
    scales = [name for name in ("k_scale_host", "v_scale_host") if getattr(pool, name, None) is not None]
    if scales:
        raise SettingsError(f"host pool {type(pool).__name__} keeps KV scales ({', '.join(scales)}): its pages are "
                            f"quantised, not float KV: {FIX}")
    head_dim = getattr(pool, "head_dim", None)
    v_head_dim = getattr(pool, "v_head_dim", head_dim)
    if v_head_dim != head_dim:
        raise SettingsError(f"host pool K head_dim {head_dim} and V head_dim {v_head_dim} differ: scd-store codes "
                            "K and V of one head size")
