"""Directories the store trusts must be writable by this process's user only.

Whoever can write a disk tier's root, the registry file's directory or the host keyring's
directory can plant blobs, un-revoke records or swap keys; so such a directory is created mode
0700 and refused when it is group- or world-writable, or owned by another user (root excepted).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from scd_store.errors import ScdStoreError


class UnsafePath(ScdStoreError, ValueError):  # noqa: N818 - the name says what it is
    """A directory (or key file) that other users could write (or read, for a private key)."""


def private_dir(path: str | os.PathLike[str], what: str) -> Path:
    """``path``, created mode 0700 when missing; :class:`UnsafePath` when others may write it."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        raise UnsafePath(f"{what} {path}: cannot create it ({exc})") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{what} {path} is not a directory")
    check_owner_only(path, st, what)
    return path


def check_owner_only(path: Path, st: os.stat_result, what: str, *, unreadable: bool = False) -> None:
    """Refuse ``path`` when group or others may write it (with ``unreadable``: read it), or when it belongs
    to another user than this process's (or root)."""
    mask = 0o077 if unreadable else 0o022
    if st.st_mode & mask:
        kind = "read or write" if unreadable else "write"
        raise UnsafePath(f"{what} {path} is mode {stat.S_IMODE(st.st_mode):04o}: other users may {kind} it; "
                         f"`chmod {'600' if unreadable else 'go-w'} {path}` (or use another directory)")
    if st.st_uid not in (os.geteuid(), 0):
        raise UnsafePath(f"{what} {path} belongs to uid {st.st_uid}, not this process's user ({os.geteuid()})")


def inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """Whether ``path`` lies in ``root`` (both resolved)."""
    path, root = Path(path).resolve(), Path(root).resolve()
    return path == root or root in path.parents
