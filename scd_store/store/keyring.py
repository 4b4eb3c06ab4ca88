"""A process's signing keys by space (:class:`Keyring`), read from key files and re-read as they change.

The keys come from a path (``signing_keys`` in the store config, ``SCD_STORE_SIGNING_KEYS``) and/or one
inline key (``SCD_STORE_SIGNING_KEY``); never from a bundle. The path is one key file, or a directory of
``<space_id>.keys`` files with an optional ``default.keys``. A key signs and verifies only the spaces it
was made for: in ``<space_id>.keys`` a key serves that space (a line naming other spaces is refused); in
``default.keys``, a single key file or the inline key every line names its spaces (``spaces=A,B``, or
``spaces=*`` for every space), and a line naming none is refused at start. A space with a file of its own
takes its keys from it alone, never from ``default.keys``.

Files are re-read when they change (checked every ``reload_s``), one file at a time, and only as an
operator's atomic replace leaves them (a new file renamed over the old one, as ``scd-store keys new`` and
any editor that saves by rename do). Every refusal keeps that file's keys, is logged once per state of the
file and reported to ``on_error`` (the store counts ``keyring_errors``):

- a file rewritten in place (same inode: truncated, then written, which a reader can see half done);
- a file that does not parse, is too large, or that other users may write;
- a name that is now a link, FIFO, device or socket.

- a file that does not end in a newline (cut short, or still being written).

A file that is gone takes its own keys with it (fails closed: its space signs and verifies nothing until it
is back), and only its own; a key directory that is gone takes every key. A file younger than
:data:`SETTLE_S` is read on a later reload (it may still be being written). The keyring keeps each file it
read open, so the file system cannot give a newer file the inode of one it remembers (two replaces between
reloads would otherwise look like an edit in place).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from scd_store.store.fs_safety import UnsafePath, check_owner_only
from scd_store.store.signing import (
    Key,
    KeyringError,
    SigningKey,
    VerifyKey,
    parse_inline_key,
    parse_key_file,
    read_key_file,
)

DEFAULT_FILE = "default.keys"
SETTLE_S = 1.0  # a key file modified less than this ago is read on a later reload
log = logging.getLogger("scd_store.store")
Stamp = tuple[int, int, int, int]  # (device, inode, mtime ns, size)


@dataclass(frozen=True, slots=True)
class _File:
    """What was read of one key file: its scope (a space id; None: ``default.keys`` or the single file), the
    stamp of the read, its keys, whether they came from a read that succeeded, and the file, held open."""

    scope: str | None
    stamp: Stamp
    keys: tuple[Key, ...]
    ok: bool = True
    fd: int | None = None

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)


def _stamp(st: os.stat_result) -> Stamp:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def scoped_keys(keys: tuple[Key, ...], scope: str | None, where: str,
                implied: tuple[str, ...] | None = None) -> tuple[Key, ...]:
    """``keys`` as a file of ``scope`` serves them: in ``<space>.keys`` each serves that space (a line naming
    other spaces is refused); elsewhere each must name its spaces (``implied`` for lines naming none, else
    refused)."""
    out: list[Key] = []
    for key in keys:
        if scope is not None:
            if key.spaces and not key.covers(scope):
                raise KeyringError(f"{where}: key {key.key_id!r} is made for spaces={','.join(key.spaces)}, not "
                                   f"for {scope!r} (whose file this is)")
            out.append(key.scoped((scope,)))
        elif key.spaces:
            out.append(key)
        elif implied is not None:
            out.append(key.scoped(implied))
        else:
            raise KeyringError(f"{where}: key {key.key_id!r} names no spaces: a key signs and verifies only the "
                               "spaces it was made for; add spaces=SPACE[,SPACE...] (or spaces=* for every space), "
                               "or move it into the key directory's <space>.keys")
    return tuple(out)


class Keyring:
    """The keys of this process, by space. ``on_error(message)`` is called for each refused reload;
    ``implied_spaces``: the spaces a line of a shared file naming none serves (None: such a line is refused)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, inline: Key | None = None, *,
                 reload_s: float = 5.0, on_error: Callable[[str], None] | None = None,
                 implied_spaces: tuple[str, ...] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.inline = scoped_keys((inline,), None, "SCD_STORE_SIGNING_KEY")[0] if inline is not None else None
        self.reload_s = reload_s
        self.on_error = on_error
        self.implied_spaces = implied_spaces
        self._files: dict[str, _File] = {}
        self._keys: dict[str | None, tuple[Key, ...]] = {}
        self._gone: set[str] = set()  # spaces whose own file went away: never served by default.keys
        self._reported: dict[str, object] = {}  # per file: the state last reported (once per state)
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        if self.path is not None:
            if not self.path.exists():
                raise KeyringError(f"signing_keys {self.path} does not exist")
            for name, path in self._listing().items():  # at start every defect is an error
                text, st, fd = read_key_file(path, keep=True)
                try:
                    self._files[name] = _File(self._scope(path), _stamp(st), self._parse(text, path), fd=fd)
                except BaseException:
                    self.close()
                    if fd is not None:
                        os.close(fd)
                    raise
        self._rebuild()

    def close(self) -> None:
        """Close the key files held open (the keys stay as read)."""
        for file in self._files.values():
            file.close()
        self._files = {name: _File(f.scope, f.stamp, f.keys, f.ok) for name, f in self._files.items()}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            for file in self._files.values():
                file.close()

    @classmethod
    def from_env(cls, path: str | None, env: Mapping[str, str]) -> Keyring | None:
        """The keyring the config's ``signing_keys`` and ``SCD_STORE_SIGNING_KEY(S)`` name, or None."""
        path = env.get("SCD_STORE_SIGNING_KEYS") or path
        inline = env.get("SCD_STORE_SIGNING_KEY")
        if not path and not inline:
            return None
        return cls(path or None, parse_inline_key(inline) if inline else None)

    @property
    def can_sign(self) -> bool:
        """Whether this keyring holds any private key (a producer's); readers hold public keys only."""
        return any(isinstance(k, SigningKey) for keys in self._keys.values() for k in keys)

    # ----------------------------------------------------------------- answers
    def signer(self, space_id: str) -> SigningKey | None:
        """The private key that signs ``space_id``'s blobs now (None: this keyring holds none made for it)."""
        now = time.time()
        return next((k for k in self._current(space_id) if isinstance(k, SigningKey) and k.valid(now)
                     and k.covers(space_id)), None)

    def verifier(self, space_id: str, key_id: str) -> VerifyKey | None:
        """The still valid public key ``key_id`` made for ``space_id``, or None."""
        now = time.time()
        for k in self._current(space_id):
            if k.key_id == key_id and k.valid(now) and k.covers(space_id):
                return k.public if isinstance(k, SigningKey) else k
        return None

    def _current(self, space_id: str) -> tuple[Key, ...]:
        now = time.monotonic()
        if self.path is not None and now - self._checked >= self.reload_s:
            self._checked = now
            self.reload()
        keys = self._keys.get(space_id)
        return keys if keys is not None else self._keys.get(None, ())

    # ----------------------------------------------------------------- files
    def _scope(self, path: Path) -> str | None:
        if self.path is not None and self.path.is_dir() and path.name != DEFAULT_FILE:
            return path.name[:-len(".keys")]
        return None

    def _parse(self, text: str, path: Path) -> tuple[Key, ...]:
        return scoped_keys(parse_key_file(text, str(path)), self._scope(path), str(path), self.implied_spaces)

    def _listing(self) -> dict[str, Path]:
        """The key files the path names (by path text); FileNotFoundError when the path is gone."""
        assert self.path is not None
        st = os.stat(self.path)
        if not stat.S_ISDIR(st.st_mode):
            return {str(self.path): self.path}
        try:
            check_owner_only(self.path, st, "the key directory")
        except UnsafePath as exc:
            raise KeyringError(str(exc)) from None
        return {str(p): p for p in sorted(self.path.glob("*.keys"))}

    def reload(self) -> None:
        """Re-read the key files that changed (see the module's rules); never raises. A reload already running
        in another thread is not waited for."""
        if self.path is None or not self._lock.acquire(blocking=False):
            return
        try:
            try:
                listing = self._listing()
            except FileNotFoundError:
                if self._files:
                    for file in self._files.values():
                        file.close()
                    self._files.clear()
                    self._report("", "gone", f"signing_keys {self.path} is gone: its keys no longer sign or verify")
                self._rebuild()
                return
            except (KeyringError, OSError) as exc:
                self._report("", str(exc), f"the key directory cannot be read, keeping every key: {exc}")
                return
            for name in [n for n in self._files if n not in listing]:
                self._vanished(name)
            for name, path in listing.items():
                self._reload_file(name, path)
            self._rebuild()
        finally:
            self._lock.release()

    def _vanished(self, name: str) -> None:
        gone = self._files.pop(name, None)
        if gone is not None:
            gone.close()
            if gone.scope is not None:
                self._gone.add(gone.scope)
            self._report(name, "gone", f"{name} is gone: its keys no longer sign or verify"
                         + (" (restart to let default.keys serve its space)" if gone.scope else ""))

    def _reload_file(self, name: str, path: Path) -> None:
        known = self._files.get(name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self._vanished(name)
            return
        if not stat.S_ISREG(st.st_mode):
            self._report(name, ("kind", st.st_mode), f"{name} is no plain file (a link, FIFO, device or socket): "
                         "refused, keeping the keys read before")
            return
        stamp = _stamp(st)
        if known is not None and known.stamp == stamp:
            return
        if known is not None and known.ok and known.stamp[:2] == stamp[:2]:
            self._report(name, stamp, f"{name} was rewritten in place, not replaced: refused (a reader could see "
                         "it half written), keeping the keys read before; write a new file and rename it over the "
                         "old one (as `scd-store keys new --append` does)")
            return
        if 0 <= time.time() - st.st_mtime < SETTLE_S:
            return  # may still be being written: read it on a later reload
        fd: int | None = None
        try:
            text, opened, fd = read_key_file(path, keep=True)
            if _stamp(opened)[:2] != stamp[:2]:  # replaced between the look and the read: read it on the next reload
                if fd is not None:
                    os.close(fd)
                return
            keys = self._parse(text, path)
        except FileNotFoundError:
            self._vanished(name)
            return
        except (KeyringError, OSError, ValueError) as exc:
            if fd is not None:
                os.close(fd)
            self._report(name, stamp, f"reloading signing keys failed, keeping the keys read before: {exc}")
            if known is None:  # nothing to keep: remember the failed read, so a fix in place is read
                self._files[name] = _File(self._scope(path), stamp, (), ok=False)
            return
        scope = self._scope(path)
        if known is not None:
            known.close()
        self._files[name] = _File(scope, _stamp(opened), keys, fd=fd)
        if scope is not None:
            self._gone.discard(scope)
        self._reported.pop(name, None)

    def _rebuild(self) -> None:
        keys: dict[str | None, tuple[Key, ...]] = dict.fromkeys(self._gone, ())
        for file in self._files.values():
            keys[file.scope] = (*keys.get(file.scope, ()), *file.keys)
        if self.inline is not None:
            keys[None] = (self.inline, *keys.get(None, ()))
        self._keys = keys

    def _report(self, name: str, state: object, message: str) -> None:
        """Log ``message`` and hand it to ``on_error``, once per state of file ``name``."""
        if self._reported.get(name) == state:
            return
        self._reported[name] = state
        log.warning("scd-store: %s", message)
        if self.on_error is not None:
            self.on_error(message)
