"""Per-space Ed25519 keys: producers sign every blob with a private key, readers verify with public keys.

A reader holds only public keys, so no reader can sign a blob any other process accepts. Every key is
made for the spaces it names (``spaces=SPACE[,SPACE...]``, or ``spaces=*`` for every space, made only on
request): a key signs and verifies blobs of those spaces only, so the producer of one space cannot sign
another's. A key file holds lines ``key_id ed25519-private:HEX [spaces=...] [until=TIME]`` (producers) or
``key_id ed25519-public:HEX [spaces=...] [until=TIME]`` (readers); ``#`` starts a comment. The first valid
private line signs; every valid line verifies (a private line by its public half); a line past its
``until`` (unix seconds or ISO-8601 UTC) no longer verifies. ``scd-store keys new`` makes a pair.
Which file holds which space's keys, and how files are re-read, is :mod:`scd_store.store.keyring`'s.

``cryptography`` is imported only when a key is made, a private key is read, or a signature is checked:
a process that never signs nor verifies (a tool reading framing only) runs without it.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import stat
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scd_store.errors import ScdStoreError
from scd_store.store.fs_safety import UnsafePath, check_owner_only
from scd_store.store.keys import KeyError_, validate_space_id

SIGNATURE_SIZE = 64  # Ed25519
KEY_BYTES = 32
ALL_SPACES = "*"
PRIVATE, PUBLIC = "ed25519-private:", "ed25519-public:"
_KEY_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_KEY_FILE_BYTES = 64 << 10


class KeyringError(ScdStoreError, ValueError):
    """An unreadable or malformed key file, or a key used outside the spaces it was made for."""


def _ed25519() -> Any:
    """cryptography's Ed25519 module, imported on first use (a clear error when it is not installed)."""
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:  # pragma: no cover - exercised by the device check's package set
        raise KeyringError("signed codes need the 'cryptography' package (pip install cryptography)") from exc
    return ed25519


def _check_id(key_id: str) -> None:
    if not isinstance(key_id, str) or not _KEY_ID_RE.match(key_id):
        raise KeyringError(f"key id {key_id!r}: use 1-64 characters [A-Za-z0-9._-]")


def _check_until(until: float | None) -> None:
    if until is not None and (isinstance(until, bool) or not isinstance(until, (int, float))
                              or not math.isfinite(until) or until <= 0):
        raise KeyringError(f"until={until!r}: a key's end of validity is a finite time after 1970")


def check_spaces(spaces: tuple[str, ...]) -> tuple[str, ...]:
    """``spaces`` if each is a valid space id, or they are ``("*",)`` (every space); () means none named yet."""
    if not isinstance(spaces, tuple):
        raise KeyringError(f"spaces must be a tuple of space ids, got {spaces!r}")
    if ALL_SPACES in spaces and spaces != (ALL_SPACES,):
        raise KeyringError("spaces=* (every space) stands alone")
    for space in spaces:
        if space != ALL_SPACES:
            try:
                validate_space_id(space)
            except KeyError_ as exc:
                raise KeyringError(str(exc)) from None
    if len(set(spaces)) != len(spaces):
        raise KeyringError(f"spaces={','.join(spaces)} names a space twice")
    return spaces


@dataclass(frozen=True, slots=True)
class VerifyKey:
    """A public key: its id (carried in every blob it verifies), 32 bytes, end of validity (None: none) and the
    spaces it verifies (``("*",)``: every space; (): none yet, see :mod:`scd_store.store.keyring`)."""

    key_id: str
    public: bytes
    until: float | None = None
    spaces: tuple[str, ...] = ()
    _key: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_id(self.key_id)
        _check_until(self.until)
        check_spaces(self.spaces)
        if len(self.public) != KEY_BYTES:
            raise KeyringError(f"key {self.key_id!r}: an Ed25519 public key is {KEY_BYTES} bytes")

    def valid(self, now: float) -> bool:
        return self.until is None or now < self.until

    def covers(self, space_id: str) -> bool:
        """Whether this key was made for ``space_id``."""
        return ALL_SPACES in self.spaces or space_id in self.spaces

    def verify(self, message: bytes, signature: bytes | memoryview) -> bool:
        """Whether ``signature`` is this key's over ``message``."""
        key = self._key
        if key is None:
            key = _ed25519().Ed25519PublicKey.from_public_bytes(self.public)
            object.__setattr__(self, "_key", key)
        from cryptography.exceptions import InvalidSignature

        try:
            key.verify(bytes(signature), message)
        except InvalidSignature:
            return False
        return True

    def scoped(self, spaces: tuple[str, ...]) -> VerifyKey:
        """This key for ``spaces``."""
        return replace(self, spaces=spaces, _key=None)

    def line(self) -> str:
        """This key as a key file line."""
        return _line(self.key_id, PUBLIC + self.public.hex(), self.spaces, self.until)


@dataclass(frozen=True, slots=True)
class SigningKey:
    """A private key (the 32-byte seed) of a producer, for ``spaces``; :attr:`public` is what readers hold."""

    key_id: str
    private: bytes
    until: float | None = None
    spaces: tuple[str, ...] = ()
    _key: Any = field(default=None, repr=False, compare=False)
    public: VerifyKey | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_id(self.key_id)
        _check_until(self.until)
        check_spaces(self.spaces)
        if len(self.private) != KEY_BYTES:
            raise KeyringError(f"key {self.key_id!r}: an Ed25519 private key is {KEY_BYTES} bytes")
        key = _ed25519().Ed25519PrivateKey.from_private_bytes(self.private)  # names the package when it is missing
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "public", VerifyKey(self.key_id, raw, self.until, self.spaces))

    @classmethod
    def generate(cls, key_id: str, *, spaces: tuple[str, ...], until: float | None = None) -> SigningKey:
        """A new key for ``spaces`` (``("*",)`` for every space: only where one signer serves them all)."""
        return cls(key_id, os.urandom(KEY_BYTES), until, spaces)

    def valid(self, now: float) -> bool:
        return self.until is None or now < self.until

    def covers(self, space_id: str) -> bool:
        """Whether this key was made for ``space_id``."""
        return ALL_SPACES in self.spaces or space_id in self.spaces

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def scoped(self, spaces: tuple[str, ...]) -> SigningKey:
        """This key for ``spaces``."""
        return SigningKey(self.key_id, self.private, self.until, spaces)

    def line(self) -> str:
        """This key as a (private) key file line."""
        return _line(self.key_id, PRIVATE + self.private.hex(), self.spaces, self.until)


Key = SigningKey | VerifyKey


def _line(key_id: str, material: str, spaces: tuple[str, ...], until: float | None) -> str:
    scope = f" spaces={','.join(spaces)}" if spaces else ""
    return f"{key_id} {material}{scope}" + (f" until={until:.0f}" if until is not None else "")


def _material(text: str, key_id: str, until: float | None, spaces: tuple[str, ...], where: str) -> Key:
    kind = PRIVATE if text.startswith(PRIVATE) else PUBLIC if text.startswith(PUBLIC) else None
    if kind is None:
        raise KeyringError(f"{where}: expected {PRIVATE}HEX or {PUBLIC}HEX (HMAC secrets are no longer accepted: "
                           "make a key pair with `scd-store keys new`)")
    try:
        raw = bytes.fromhex(text[len(kind):])
    except ValueError:
        raise KeyringError(f"{where}: the key is not hex") from None
    return SigningKey(key_id, raw, until, spaces) if kind == PRIVATE else VerifyKey(key_id, raw, until, spaces)


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


def parse_spaces(text: str, where: str) -> tuple[str, ...]:
    """``a,b`` or ``*`` (a ``spaces=`` value) as a tuple of space ids."""
    spaces = tuple(part for part in text.split(",") if part)
    if not spaces:
        raise KeyringError(f"{where}: spaces= names no space (give SPACE[,SPACE...] or *)")
    try:
        return check_spaces(spaces)
    except KeyringError as exc:
        raise KeyringError(f"{where}: {exc}") from None


def _options(words: list[str], where: str) -> tuple[tuple[str, ...], float | None]:
    """The ``spaces=`` and ``until=`` options of a key line (each at most once, nothing else)."""
    seen: dict[str, str] = {}
    for word in words:
        name, sep, value = word.partition("=")
        if not sep or name not in ("spaces", "until") or name in seen:
            raise KeyringError(f"{where}: expected 'key_id {PRIVATE}HEX|{PUBLIC}HEX [spaces=SPACE,...|*] "
                               f"[until=TIME]', got {word!r}")
        seen[name] = value
    spaces = parse_spaces(seen["spaces"], where) if "spaces" in seen else ()
    until = parse_until(seen["until"], where) if "until" in seen else None
    return spaces, until


def parse_key_file(text: str, where: str) -> tuple[Key, ...]:
    """The keys of one key file, in order (the first private one signs), each with the spaces its line names
    (possibly none: which a file may leave unnamed is the keyring's rule)."""
    keys: list[Key] = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        at = f"{where}:{n}"
        if len(words) < 2:
            raise KeyringError(f"{at}: expected 'key_id {PRIVATE}HEX|{PUBLIC}HEX [spaces=...] [until=TIME]'")
        spaces, until = _options(words[2:], at)
        try:
            keys.append(_material(words[1], words[0], until, spaces, at))
        except KeyringError as exc:
            raise KeyringError(str(exc) if str(exc).startswith(at) else f"{at}: {exc}") from None
    if len({k.key_id for k in keys}) != len(keys):
        raise KeyringError(f"{where}: a key id appears twice")
    return tuple(keys)


def parse_inline_key(text: str) -> Key:
    """``key_id:ed25519-private:HEX spaces=...`` or ``key_id:ed25519-public:HEX spaces=...``
    (``SCD_STORE_SIGNING_KEY``)."""
    head, *options = text.split()
    key_id, sep, material = head.partition(":")
    if not sep:
        raise KeyringError(f"SCD_STORE_SIGNING_KEY must be 'key_id:{PRIVATE}HEX spaces=SPACE' or "
                           f"'key_id:{PUBLIC}HEX spaces=SPACE'")
    spaces, until = _options(options, "SCD_STORE_SIGNING_KEY")
    return _material(material.strip(), key_id.strip(), until, spaces, "SCD_STORE_SIGNING_KEY")


def read_key_file(path: Path, *, keep: bool = False) -> tuple[str, os.stat_result, int | None]:
    """A key file's text, the status of what was read and, with ``keep``, a descriptor of it left open (the caller
    closes it: while it is open the file's inode cannot be given to another file). The file is a regular file
    (never a link, FIFO or device) of at most 64 KiB that other users cannot write (nor read, when it holds
    private keys), and whole: empty, or ending in a newline (a file cut short is refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise KeyringError(f"{path}: cannot open it as a plain file ({exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_KEY_FILE_BYTES:
            raise KeyringError(f"{path} is no regular file of at most {MAX_KEY_FILE_BYTES} bytes")
        data = b""
        while len(data) <= MAX_KEY_FILE_BYTES and (part := os.read(fd, MAX_KEY_FILE_BYTES + 1 - len(data))):
            data += part
        check_owner_only(path, st, "the key file")
        text = data.decode("utf-8")
        if PRIVATE in text:
            check_owner_only(path, st, "the private key file", unreadable=True)
        if text and not text.endswith("\n"):
            raise KeyringError(f"{path} does not end in a newline: cut short, or still being written")
    except (UnsafePath, UnicodeDecodeError) as exc:
        os.close(fd)
        raise KeyringError(str(exc)) from None
    except BaseException:
        os.close(fd)
        raise
    if not keep:
        os.close(fd)
        return text, st, None
    return text, st, fd


def write_key_file(path: Path, lines: list[str], *, private: bool, append: bool = False) -> None:
    """Write (or, with ``append``, extend) a key file atomically (a new file renamed over the old one: readers
    never see half of it); private files are created mode 0600."""
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
