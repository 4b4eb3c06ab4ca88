"""Per-space Ed25519 keys: producers sign every blob with a private key, readers verify with public keys.

A reader holds only public keys, so no reader can sign a blob any other process accepts. A keyring
comes from a path (``signing_keys`` in the store config, ``SCD_STORE_SIGNING_KEYS``) and/or one
inline key (``SCD_STORE_SIGNING_KEY=key_id:ed25519-private:HEX``); never from a bundle. The path is
a key file used for every space, or a directory of ``<space_id>.keys`` files with an optional
``default.keys`` for the others. A key file holds lines ``key_id ed25519-private:HEX [until=TIME]``
(producers) or ``key_id ed25519-public:HEX [until=TIME]`` (readers); ``#`` starts a comment. The
first valid private line signs; every valid line verifies (a private line by its public half); a
line past its ``until`` (unix seconds or ISO-8601 UTC) no longer verifies. ``scd-store keys new``
makes a pair. Rotation: add the new public line everywhere, then the new private line first on
producers, then give the old lines an ``until`` (or remove them) once blobs they signed expired.

Files are re-read when they change (checked every ``reload_s``): a file that no longer parses keeps
the keys read before (logged and counted: ``on_error``); a key file or directory that is gone takes
its keys with it (fails closed: nothing signs or verifies until it is back).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from scd_store.errors import ScdStoreError
from scd_store.store.fs_safety import UnsafePath, check_owner_only

SIGNATURE_SIZE = 64  # Ed25519
KEY_BYTES = 32
DEFAULT_FILE = "default.keys"
PRIVATE, PUBLIC = "ed25519-private:", "ed25519-public:"
_KEY_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
log = logging.getLogger("scd_store.store")


class KeyringError(ScdStoreError, ValueError):
    """An unreadable or malformed key file."""


def _check_id(key_id: str) -> None:
    if not isinstance(key_id, str) or not _KEY_ID_RE.match(key_id):
        raise KeyringError(f"key id {key_id!r}: use 1-64 characters [A-Za-z0-9._-]")


def _check_until(until: float | None) -> None:
    if until is not None and (isinstance(until, bool) or not isinstance(until, (int, float))
                              or not math.isfinite(until) or until <= 0):
        raise KeyringError(f"until={until!r}: a key's end of validity is a finite time after 1970")


@dataclass(frozen=True, slots=True)
class VerifyKey:
    """A public key: its id (carried in every blob it verifies), 32 bytes, end of validity (None: none)."""

    key_id: str
    public: bytes
    until: float | None = None
    _key: Ed25519PublicKey | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_id(self.key_id)
        _check_until(self.until)
        if len(self.public) != KEY_BYTES:
            raise KeyringError(f"key {self.key_id!r}: an Ed25519 public key is {KEY_BYTES} bytes")
        object.__setattr__(self, "_key", Ed25519PublicKey.from_public_bytes(self.public))

    def valid(self, now: float) -> bool:
        return self.until is None or now < self.until

    def verify(self, message: bytes, signature: bytes | memoryview) -> bool:
        """Whether ``signature`` is this key's over ``message``."""
        assert self._key is not None
        try:
            self._key.verify(bytes(signature), message)
        except InvalidSignature:
            return False
        return True

    def line(self) -> str:
        """This key as a key file line."""
        return _line(self.key_id, PUBLIC + self.public.hex(), self.until)


@dataclass(frozen=True, slots=True)
class SigningKey:
    """A private key (the 32-byte seed) of a producer; :attr:`public` is what readers hold."""

    key_id: str
    private: bytes
    until: float | None = None
    _key: Ed25519PrivateKey | None = field(default=None, repr=False, compare=False)
    public: VerifyKey | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_id(self.key_id)
        _check_until(self.until)
        if len(self.private) != KEY_BYTES:
            raise KeyringError(f"key {self.key_id!r}: an Ed25519 private key is {KEY_BYTES} bytes")
        key = Ed25519PrivateKey.from_private_bytes(self.private)
        raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "public", VerifyKey(self.key_id, raw, self.until))

    @classmethod
    def generate(cls, key_id: str, until: float | None = None) -> SigningKey:
        return cls(key_id, os.urandom(KEY_BYTES), until)

    def valid(self, now: float) -> bool:
        return self.until is None or now < self.until

    def sign(self, message: bytes) -> bytes:
        assert self._key is not None
        return self._key.sign(message)

    def line(self) -> str:
        """This key as a (private) key file line."""
        return _line(self.key_id, PRIVATE + self.private.hex(), self.until)


Key = SigningKey | VerifyKey


def _line(key_id: str, material: str, until: float | None) -> str:
    return f"{key_id} {material}" + (f" until={until:.0f}" if until is not None else "")


def _material(text: str, key_id: str, until: float | None, where: str) -> Key:
    kind = PRIVATE if text.startswith(PRIVATE) else PUBLIC if text.startswith(PUBLIC) else None
    if kind is None:
        raise KeyringError(f"{where}: expected {PRIVATE}HEX or {PUBLIC}HEX (HMAC secrets are no longer accepted: "
                           "make a key pair with `scd-store keys new`)")
    try:
        raw = bytes.fromhex(text[len(kind):])
    except ValueError:
        raise KeyringError(f"{where}: the key is not hex") from None
    return SigningKey(key_id, raw, until) if kind == PRIVATE else VerifyKey(key_id, raw, until)


def parse_until(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        try:
            stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError as exc:
            raise KeyringError(f"{where}: until={text!r} is neither unix seconds nor ISO-8601") from exc
        value = (stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)).timestamp()
    if not math.isfinite(value) or value <= 0:
        raise KeyringError(f"{where}: until={text!r} is not a finite time after 1970")
    return value


def parse_key_file(text: str, where: str) -> tuple[Key, ...]:
    """The keys of one key file, in order (the first private one signs)."""
    keys: list[Key] = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        at = f"{where}:{n}"
        if len(fields) not in (2, 3) or (len(fields) == 3 and not fields[2].startswith("until=")):
            raise KeyringError(f"{at}: expected 'key_id {PRIVATE}HEX|{PUBLIC}HEX [until=TIME]'")
        until = parse_until(fields[2][6:], at) if len(fields) == 3 else None
        try:
            keys.append(_material(fields[1], fields[0], until, at))
        except KeyringError as exc:
            raise KeyringError(str(exc) if str(exc).startswith(at) else f"{at}: {exc}") from None
    if len({k.key_id for k in keys}) != len(keys):
        raise KeyringError(f"{where}: a key id appears twice")
    return tuple(keys)


def parse_inline_key(text: str) -> Key:
    """``key_id:ed25519-private:HEX`` or ``key_id:ed25519-public:HEX`` (``SCD_STORE_SIGNING_KEY``)."""
    key_id, sep, material = text.strip().partition(":")
    if not sep:
        raise KeyringError(f"SCD_STORE_SIGNING_KEY must be 'key_id:{PRIVATE}HEX' or 'key_id:{PUBLIC}HEX'")
    return _material(material.strip(), key_id.strip(), None, "SCD_STORE_SIGNING_KEY")


class Keyring:
    """The keys of this process, by space (``None``: every space without its own file).

    ``on_error(message)`` is called for each failed reload (a file that does not parse, or is gone)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, inline: Key | None = None, *,
                 reload_s: float = 5.0, on_error: Callable[[str], None] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.inline = inline
        self.reload_s = reload_s
        self.on_error = on_error
        self._keys: dict[str | None, tuple[Key, ...]] = {}
        self._stamp: tuple = ()
        self._failed_stamp: tuple | None = None
        self._checked = time.monotonic()
        if self.path is not None and not self.path.exists():
            raise KeyringError(f"signing_keys {self.path} does not exist")
        self._keys, self._stamp = self._read()

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

    def _files(self) -> list[Path]:
        if self.path is None:
            return []
        if self.path.is_dir():
            try:
                check_owner_only(self.path, os.stat(self.path), "the key directory")
            except UnsafePath as exc:
                raise KeyringError(str(exc)) from None
            return sorted(self.path.glob("*.keys"))
        if not self.path.exists():
            raise FileNotFoundError(f"signing_keys {self.path} is gone")
        return [self.path]

    def _stamp_of(self, files: list[Path]) -> tuple:
        return tuple((str(f), st.st_mtime_ns, st.st_size, st.st_ino) for f in files for st in [os.lstat(f)])

    def _read(self) -> tuple[dict[str | None, tuple[Key, ...]], tuple]:
        files = self._files()
        stamp = self._stamp_of(files)
        keys: dict[str | None, tuple[Key, ...]] = {}
        for f in files:
            scope = None if (self.path is None or not self.path.is_dir() or f.name == DEFAULT_FILE) \
                else f.name[:-len(".keys")]
            keys[scope] = parse_key_file(read_key_file(f), str(f))
        gone = [scope for scope in self._keys if scope is not None and scope not in keys]
        for scope in gone:  # a space's own file removed: its keys end, never the default's in their place
            keys[scope] = ()
        if self.inline is not None:
            keys[None] = (self.inline, *keys.get(None, ()))
        if gone:
            self._fail(stamp, f"the key files of spaces {sorted(gone)} are gone: their blobs no longer sign or "
                       "verify (restart to let default.keys serve them)", drop=False)
        return keys, stamp

    def reload(self) -> None:
        """Re-read the key files if they changed: a file that does not parse keeps the keys read before, a
        path that is gone drops them (both logged and reported to ``on_error``)."""
        if self.path is None:
            return
        stamp: tuple = ("unreadable",)
        try:
            files = self._files()
            stamp = self._stamp_of(files)
            if stamp == self._stamp:
                return
            failed = self._failed_stamp
            self._keys, self._stamp = self._read()
            if self._failed_stamp is failed:
                self._failed_stamp = None
        except FileNotFoundError as exc:
            self._fail(("gone",), f"{exc}: its keys no longer sign or verify", drop=True)
        except Exception as exc:  # noqa: BLE001 - any failure keeps the keys read before (logged, counted)
            self._fail(stamp, f"reloading signing keys failed, keeping the keys read before: {exc}", drop=False)

    def _fail(self, stamp: tuple, message: str, *, drop: bool) -> None:
        if drop:
            self._keys = {None: (self.inline,)} if self.inline is not None else {}
            self._stamp = ()
        if stamp != self._failed_stamp:  # once per state of the files
            self._failed_stamp = stamp
            log.warning("scd-store: %s", message)
            if self.on_error is not None:
                self.on_error(message)

    def _current(self, space_id: str) -> tuple[Key, ...]:
        now = time.monotonic()
        if self.path is not None and now - self._checked >= self.reload_s:
            self._checked = now
            self.reload()
        keys = self._keys.get(space_id)
        return keys if keys is not None else self._keys.get(None, ())

    def signer(self, space_id: str) -> SigningKey | None:
        """The private key that signs ``space_id``'s blobs now (None: this keyring holds none for it)."""
        now = time.time()
        return next((k for k in self._current(space_id) if isinstance(k, SigningKey) and k.valid(now)), None)

    def verifier(self, space_id: str, key_id: str) -> VerifyKey | None:
        """The still valid public key ``key_id`` of ``space_id``, or None."""
        now = time.time()
        for k in self._current(space_id):
            if k.key_id == key_id and k.valid(now):
                return k.public if isinstance(k, SigningKey) else k
        return None


MAX_KEY_FILE_BYTES = 64 << 10


def read_key_file(path: Path) -> str:
    """A key file's text: a regular file (never a link, FIFO or device), at most 64 KiB, that other users cannot
    write (nor read, when it holds private keys)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise KeyringError(f"{path}: cannot open it as a plain file ({exc})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_KEY_FILE_BYTES:
            raise KeyringError(f"{path} is no regular file of at most {MAX_KEY_FILE_BYTES} bytes")
        data = f.read(MAX_KEY_FILE_BYTES + 1)
    try:
        check_owner_only(path, st, "the key file")
        text = data.decode("utf-8")
        if PRIVATE in text:
            check_owner_only(path, st, "the private key file", unreadable=True)
    except (UnsafePath, UnicodeDecodeError) as exc:
        raise KeyringError(str(exc)) from None
    return text


def write_key_file(path: Path, lines: list[str], *, private: bool, append: bool = False) -> None:
    """Write (or, with ``append``, extend) a key file atomically; private files are created mode 0600."""
    old = path.read_text() if append and path.exists() else ""
    if not append and path.exists():
        raise KeyringError(f"{path} exists: pass --append to add a key to it (rotation)")
    text = old + ("" if not old or old.endswith("\n") else "\n") + "".join(line + "\n" for line in lines)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
