"""Per-space signing keys: producers tag every blob with an HMAC, readers accept only valid tags.

A keyring comes from a path (``signing_keys`` in the store config, ``SCD_STORE_SIGNING_KEYS``) and/or
one inline key (``SCD_STORE_SIGNING_KEY=key_id:hex``); never from a bundle. The path is a key file
used for every space, or a directory of ``<space_id>.keys`` files with an optional ``default.keys``
for the others. A key file holds lines ``key_id secret [until=TIME]`` (``#`` comments): the secret is
hex (at least 16 bytes) or ``base64:...``; the first valid line signs, every valid line verifies, and
a line past its ``until`` (unix seconds or ISO-8601 UTC) no longer verifies. Rotation: add the new
key as a second line everywhere, move it first on producers, then give the old one an ``until``
(or remove it) once blobs it signed have expired. Files are re-read when they change (checked
every ``reload_s``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

TAG_SIZE = 32  # HMAC-SHA256
MIN_SECRET_BYTES = 16
DEFAULT_FILE = "default.keys"
_KEY_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class KeyringError(ValueError):
    """An unreadable or malformed signing key file."""


@dataclass(frozen=True, slots=True)
class SigningKey:
    """One secret: its id (carried in every blob it signs), bytes and end of validity (None: none)."""

    key_id: str
    secret: bytes
    until: float | None = None

    def __post_init__(self) -> None:
        if not _KEY_ID_RE.match(self.key_id):
            raise KeyringError(f"signing key id {self.key_id!r}: use 1-64 characters [A-Za-z0-9._-]")
        if len(self.secret) < MIN_SECRET_BYTES:
            raise KeyringError(f"signing key {self.key_id!r} is {len(self.secret)} bytes; use at least "
                               f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")

    def valid(self, now: float) -> bool:
        return self.until is None or now < self.until

    def tag(self, key: str, body: bytes | memoryview) -> bytes:
        """HMAC-SHA256 over the store key and the blob body: a tag moved to another key does not verify."""
        mac = hmac.new(self.secret, key.encode() + b"\0", "sha256")
        mac.update(body)
        return mac.digest()


def _secret(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text[7:], validate=True) if text.startswith("base64:") else bytes.fromhex(text)
    except (ValueError, binascii.Error) as exc:
        raise KeyringError(f"{where}: the secret is neither hex nor base64:... ({exc})") from None


def _until(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise KeyringError(f"{where}: until={text!r} is neither unix seconds nor ISO-8601") from exc
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)).timestamp()


def parse_key_file(text: str, where: str) -> tuple[SigningKey, ...]:
    """The keys of one key file (first = the signing key)."""
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        at = f"{where}:{n}"
        if len(fields) not in (2, 3) or (len(fields) == 3 and not fields[2].startswith("until=")):
            raise KeyringError(f"{at}: expected 'key_id secret [until=TIME]'")
        until = _until(fields[2][6:], at) if len(fields) == 3 else None
        keys.append(SigningKey(fields[0], _secret(fields[1], at), until))
    if len({k.key_id for k in keys}) != len(keys):
        raise KeyringError(f"{where}: a key id appears twice")
    return tuple(keys)


def parse_inline_key(text: str) -> SigningKey:
    """``key_id:secret`` (``SCD_STORE_SIGNING_KEY``)."""
    key_id, sep, secret = text.partition(":")
    if not sep:
        raise KeyringError("SCD_STORE_SIGNING_KEY must be 'key_id:secret' (hex or base64:...)")
    return SigningKey(key_id.strip(), _secret(secret.strip(), "SCD_STORE_SIGNING_KEY"))


class Keyring:
    """The signing keys of this process, by space (``None``: every space without its own file)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, inline: SigningKey | None = None, *,
                 reload_s: float = 5.0) -> None:
        self.path = Path(path) if path is not None else None
        self.inline = inline
        self.reload_s = reload_s
        self._keys: dict[str | None, tuple[SigningKey, ...]] = {}
        self._stamp: tuple = ()
        self._checked = 0.0
        if self.path is not None and not self.path.exists():
            raise KeyringError(f"signing_keys {self.path} does not exist")
        self._load()

    @classmethod
    def from_env(cls, path: str | None, env: Mapping[str, str]) -> Keyring | None:
        """The keyring the config's ``signing_keys`` and ``SCD_STORE_SIGNING_KEY(S)`` name, or None."""
        path = env.get("SCD_STORE_SIGNING_KEYS") or path
        inline = env.get("SCD_STORE_SIGNING_KEY")
        if not path and not inline:
            return None
        return cls(path or None, parse_inline_key(inline) if inline else None)

    def _files(self) -> list[Path]:
        if self.path is None:
            return []
        return sorted(self.path.glob("*.keys")) if self.path.is_dir() else [self.path]

    def _load(self) -> None:
        files = self._files()
        stamp = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
        if stamp == self._stamp and self._keys:
            return
        keys: dict[str | None, tuple[SigningKey, ...]] = {}
        for f in files:
            scope = None if (not self.path.is_dir() or f.name == DEFAULT_FILE) else f.name[:-len(".keys")]
            keys[scope] = parse_key_file(f.read_text(), str(f))
        if self.inline is not None:
            keys[None] = (self.inline, *keys.get(None, ()))
        self._keys, self._stamp = keys, stamp

    def _current(self, space_id: str) -> tuple[SigningKey, ...]:
        now = time.monotonic()
        if self.path is not None and now - self._checked >= self.reload_s:
            self._checked = now
            with contextlib.suppress(OSError, KeyringError):  # a half-written key file: keep the keys read before
                self._load()
        keys = self._keys.get(space_id)
        return keys if keys is not None else self._keys.get(None, ())

    def signer(self, space_id: str) -> SigningKey | None:
        """The key that signs ``space_id``'s blobs now (None: this keyring holds none for it)."""
        now = time.time()
        return next((k for k in self._current(space_id) if k.valid(now)), None)

    def verifier(self, space_id: str, key_id: str) -> SigningKey | None:
        """The still valid key ``key_id`` of ``space_id``, or None."""
        now = time.time()
        return next((k for k in self._current(space_id) if k.key_id == key_id and k.valid(now)), None)
