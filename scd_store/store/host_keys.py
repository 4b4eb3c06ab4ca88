"""The host keyring: signing keys made on first use for tiers only this host's processes share.

A disk tier is shared by every process of a host that names its directory, so its blobs are signed
too. Where no keys are configured and no tier reaches other hosts, the store signs and verifies with
``<data dir>/keys/host.keys``: an Ed25519 private key made by the first process that needs it (mode
0600, in a 0700 directory, created whole or not at all). Every process of this user that shares
``SCD_STORE_HOME`` uses it; other users can neither read it nor plant blobs they would accept. The host key
serves every space of the host (``spaces=*``: one user's processes share it, as they share the directory).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path

from scd_store.store.fs_safety import check_owner_only, private_dir
from scd_store.store.keyring import Keyring
from scd_store.store.signing import ALL_SPACES, SigningKey

HOST_FILE = "host.keys"


def host_key_id() -> str:
    """``host-<hostname>`` in the characters a key id may hold."""
    return "host-" + (re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:40] or "local")


def host_keyring(directory: str | os.PathLike[str], *, on_error: Callable[[str], None] | None = None) -> Keyring:
    """The keyring of ``directory/host.keys``, making its key first when there is none."""
    directory = private_dir(directory, "the host keyring directory")
    path = Path(directory) / HOST_FILE
    if not path.exists():
        tmp = path.with_name(f".{HOST_FILE}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(SigningKey.generate(host_key_id(), spaces=(ALL_SPACES,)).line() + "\n")
            with contextlib.suppress(FileExistsError):  # another process made it first: use theirs
                os.link(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    check_owner_only(path, os.stat(path), "the host private key", unreadable=True)
    return Keyring(path, on_error=on_error, implied_spaces=(ALL_SPACES,))  # a host file made before keys had scopes


def deployment_keys(directory: str | os.PathLike[str], key_id: str = "deployment") -> tuple[Path, Path]:
    """A private and a public key file under ``directory`` (made once): for tools that start a whole
    deployment on one machine (the demo, the benches). Producers get the private file, readers the public one.
    Its key serves every space (``spaces=*``), as such a tool's single producer process does."""
    from scd_store.store.signing import write_key_file

    directory = private_dir(directory, "the deployment's key directory")
    private, public = Path(directory) / "private.keys", Path(directory) / "public.keys"
    if not (private.exists() and public.exists() and _scoped(private) and _scoped(public)):
        key = SigningKey.generate(key_id, spaces=(ALL_SPACES,))
        assert key.public is not None
        for path in (private, public):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        write_key_file(private, [key.line()], private=True)
        write_key_file(public, [key.public.line()], private=False)
    return private, public


def _scoped(path: Path) -> bool:
    """Whether every line of key file ``path`` names its spaces (files made before keys had scopes do not)."""
    from scd_store.store.signing import KeyringError, parse_key_file

    try:
        return all(key.spaces for key in parse_key_file(path.read_text(), str(path)))
    except (KeyringError, OSError, UnicodeDecodeError):
        return False
