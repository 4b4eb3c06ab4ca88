"""The optional native CPU kernels of the decode (``kv_write.c``): the last pass (token-major
features plus the maps' offsets into the KV cache, keys re-rotated) as one OpenMP loop instead of
five PyTorch ops, and the row gather with its float conversion as one loop instead of two ops.

Built on first use with the system C compiler (``$CC``, else ``cc`` or ``gcc``; ``-O3
-march=native -fopenmp``) into ``<data dir>/native/``, keyed by the source, the flags and this
CPU's feature flags, and loaded with ctypes. It links the OpenMP runtime PyTorch has already
loaded (``libgomp.so.1``), so both share one thread pool. Everything falls back to the PyTorch
ops when ``SCD_STORE_NATIVE=0``, when there is no compiler or the build fails (logged once), or
when a call's tensors are not the plain CPU float32 layout the kernel expects.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from scd_store.paths import data_dir

log = logging.getLogger("scd_store.codecs")

SOURCE = Path(__file__).with_name("kv_write.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def enabled() -> bool:
    """False when ``SCD_STORE_NATIVE=0`` asks for the PyTorch path only."""
    return os.environ.get("SCD_STORE_NATIVE", "1") != "0"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, source: bytes) -> Path:
    """The shared library for ``source``, compiled once per source, flags and CPU."""
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), compiler.encode(), _cpu_flags().encode(),
                                     platform.machine().encode()])).hexdigest()[:20]
    directory = data_dir() / "native"
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"kv_write-{key}.so"
    if not library.exists():
        fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, "-o", partial, str(SOURCE)], check=True, capture_output=True,
                           text=True, timeout=120)
            os.replace(partial, library)  # atomic: concurrent builders never load a half-written file
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return library


@functools.cache
def _kernel():
    """The loaded ``scd_write_kv`` function (``scd_gather_codes`` as its ``gather``), or None (PyTorch fallback)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: the SCD decode uses PyTorch ops for its last pass")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler, SOURCE.read_bytes())))
        function = library.scd_write_kv
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native SCD kernel unavailable (%s): using PyTorch ops", str(detail).strip()[:500])
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64]
    function.restype = None
    library.scd_gather_codes.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr]
    library.scd_gather_codes.restype = None
    function.gather = library.scd_gather_codes
    return function


def available() -> bool:
    """Whether the native kernel is enabled and loaded (builds it on first call)."""
    return enabled() and _kernel() is not None


def _plain(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32


def write_kv(features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys_out: torch.Tensor,
             values_out: torch.Tensor, offset: torch.Tensor | None = None) -> bool:
    """Write ``features`` ``[2 L, T, H * D]`` (plus ``offset`` ``[2 L, 1, H * D]`` when given) into
    ``keys_out`` / ``values_out`` ``[L, H, T, D]`` (keys rotated by the half tables ``cos`` / ``sin``
    ``[T, D / 2]``) natively. Returns False,
    having written nothing, when the kernel is off or unavailable or the tensors are not laid out
    as it expects; the caller then uses PyTorch ops."""
    if not enabled() or keys_out.dim() != 4 or features.dim() != 3:
        return False
    layers, heads, tokens, head_dim = keys_out.shape
    if (tuple(values_out.shape) != (layers, heads, tokens, head_dim) or values_out.stride() != keys_out.stride()
            or tuple(features.shape) != (2 * layers, tokens, heads * head_dim)
            or tuple(cos.shape) != (tokens, head_dim // 2) or tuple(sin.shape) != tuple(cos.shape)
            or head_dim % 2 or keys_out.stride()[2:] != (head_dim, 1)):
        return False
    if offset is not None and tuple(offset.shape) != (2 * layers, 1, heads * head_dim):
        return False
    tensors = (features, cos, sin, keys_out, values_out) + (() if offset is None else (offset,))
    if not all(_plain(t) for t in tensors) or not all(t.is_contiguous() for t in tensors[:3] + tensors[5:]):
        return False
    kernel = _kernel()
    if kernel is None:
        return False
    kernel(features.data_ptr(), layers, tokens, heads, head_dim, cos.data_ptr(), sin.data_ptr(),
           None if offset is None else offset.data_ptr(), keys_out.data_ptr(), values_out.data_ptr(),
           keys_out.stride(0), keys_out.stride(1))
    return True


def gather_codes(codes: torch.Tensor, rows: torch.Tensor, first: int, tokens: int, out: torch.Tensor) -> bool:
    """``out[i] = codes[rows[i], first:first + tokens]`` converted to float32 (``codes`` uint8
    ``[R, S]``, ``rows`` int64 ``[n]``, ``out`` ``[n, tokens]``) in one native pass instead of a
    gather and a conversion. False, having written nothing, when the kernel is off or unavailable
    or the tensors are not that layout (rows out of range included)."""
    if not enabled() or codes.dim() != 2 or rows.dim() != 1:
        return False
    if (codes.dtype != torch.uint8 or rows.dtype != torch.int64 or out.dtype != torch.float32
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in (codes, rows, out))
            or tuple(out.shape) != (rows.numel(), tokens) or first < 0 or first + tokens > codes.shape[1]):
        return False
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= codes.shape[0]):
        return False
    kernel = _kernel()
    if kernel is None:
        return False
    kernel.gather(codes.data_ptr(), codes.shape[1], rows.data_ptr(), rows.numel(), first, tokens, out.data_ptr())
    return True
