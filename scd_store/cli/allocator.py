"""The CLI process's allocator setting: keep freed large blocks for reuse (glibc).

glibc serves blocks over its mmap threshold (at most 32 MiB) with fresh ``mmap`` pages and unmaps
them on free, so every 2,048-token decode's 47 MB key and value tensors fault in and zero ~23k new
pages: ~16 ms of a ~49 ms decode on 2 cores (measured on 2026-12-01:
docs/research/2026-12-01-decode-into-buffers-allocator.md). ``mallopt(M_MMAP_MAX, 0)`` serves them
from the heap instead, and ``M_TRIM_THRESHOLD`` keeps up to 1 GiB of freed heap mapped, so freed
blocks are reused, as CPU serving stacks get from jemalloc or tcmalloc. Only the
``scd-store`` process does this; an engine embedding scd-store keeps its own allocator
(``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...`` in its environment has the same effect with glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from scd_store.flags import parse_flag

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters: free heap top kept before returning it to the system,
M_MMAP_MAX = -4  # and how many blocks may be served by mmap
KEEP_BYTES = 1 << 30  # up to 1 GiB of freed heap stays mapped for reuse
KEEP_DEFAULT = "SCD_STORE_GLIBC_MMAP"  # true: leave glibc's default

log = logging.getLogger("scd_store.cli")


def glibc_default_wanted(value: str | None) -> bool:
    """Whether ``SCD_STORE_GLIBC_MMAP`` (``value``) asks for glibc's default: a true flag does; unset or false
    does not, and neither does any other value, which is logged as ignored."""
    if value is None:
        return False
    try:
        return parse_flag(value, KEEP_DEFAULT)
    except ValueError as exc:
        log.warning("scd-store: %s: ignored, freed blocks are reused", exc)
        return False


def keep_freed_blocks() -> str:
    """Apply the setting where the C library is glibc and ``SCD_STORE_GLIBC_MMAP`` is not true;
    returns what the process's allocator does now (a bench report records it)."""
    if glibc_default_wanted(os.environ.get(KEEP_DEFAULT)):
        return f"glibc default ({KEEP_DEFAULT}={os.environ[KEEP_DEFAULT]})"
    name = ctypes.util.find_library("c")
    if not name:
        return "system default"
    try:
        libc = ctypes.CDLL(name)
        mallopt, version = libc.mallopt, libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return "system default (not glibc)"
    version.restype = ctypes.c_char_p
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) != 1:
        return f"glibc {version().decode()} default (mallopt refused)"
    return f"glibc {version().decode()}, large blocks reused (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=1 GiB)"
