"""Registry of code spaces and pairs: in Redis when configured, else a local JSON file.

A space is written by exactly one producer model; a pair maps a consumer model to one space. A
consumer that is not registered for a space gets :class:`NotRegistered`, never codes. A space's
producer also records its engine's hashing canary, so consumers can check they hash alike.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scd_store.store.keys import validate_space_id

REDIS_PREFIX = "scd:__registry__"
REDIS_SPACES = f"{REDIS_PREFIX}:spaces"
REDIS_PAIRS = f"{REDIS_PREFIX}:pairs"
# canaries: each space's producer hashing, per engine; locations: the bundle directory of a space or pair
KINDS = ("spaces", "pairs", "canaries", "locations")


class RegistryError(ValueError):
    """A registry problem (conflicting registration, unreadable registry)."""


class NotRegistered(RegistryError):  # noqa: N818 - the name the issue uses
    """A pair or space that the registry does not know, or a consumer not registered for it."""


class NotAuthorized(RegistryError):  # noqa: N818
    """A model tried to write into a space it does not produce."""


@dataclass(frozen=True, slots=True)
class Space:
    """A code space: one producer model and its encoder bundle."""

    space_id: str
    producer_model_id: str
    producer_fingerprint: str
    bundle_fingerprint: str
    codec_id: str = ""
    chunk_size: int = 256
    raw_kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        validate_space_id(self.space_id)
        for name in ("producer_model_id", "producer_fingerprint", "bundle_fingerprint"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise RegistryError(f"space {self.space_id!r}: {name} must be a non-empty string")

    @property
    def fingerprint(self) -> str:
        """What every blob of this space carries as its space fingerprint."""
        return self.bundle_fingerprint


@dataclass(frozen=True, slots=True)
class Pair:
    """A consumer model registered against one space, with its decoder bundle."""

    pair_id: str
    space_id: str
    consumer_model_id: str
    consumer_fingerprint: str
    bundle_fingerprint: str

    def __post_init__(self) -> None:
        validate_space_id(self.space_id)
        for name in ("pair_id", "consumer_model_id", "consumer_fingerprint", "bundle_fingerprint"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise RegistryError(f"pair {self.pair_id!r}: {name} must be a non-empty string")


def _space(obj: dict[str, Any]) -> Space:
    return Space(**obj)


def _pair(obj: dict[str, Any]) -> Pair:
    return Pair(**obj)


class Registry(ABC):
    """Spaces and pairs. ``register_*`` is idempotent for an identical record and refuses a different one
    unless ``replace=True``."""

    @abstractmethod
    def _load(self, kind: str, ident: str) -> dict[str, Any] | None: ...

    @abstractmethod
    def _store(self, kind: str, ident: str, record: dict[str, Any], replace: bool) -> dict[str, Any] | None:
        """Write ``record``; return the existing different record instead when one exists and not ``replace``."""

    @abstractmethod
    def _all(self, kind: str) -> dict[str, dict[str, Any]]: ...

    def register_space(self, space: Space, *, replace: bool = False) -> Space:
        existing = self._store("spaces", space.space_id, asdict(space), replace)
        if existing is not None:
            raise RegistryError(f"space {space.space_id!r} is already registered with different contents "
                                f"(producer {existing.get('producer_model_id')!r}); pass replace=True to change it")
        return space

    def register_pair(self, pair: Pair, *, replace: bool = False) -> Pair:
        self.space(pair.space_id)
        existing = self._store("pairs", pair.pair_id, asdict(pair), replace)
        if existing is not None:
            raise RegistryError(f"pair {pair.pair_id!r} is already registered with different contents "
                                f"(space {existing.get('space_id')!r}); pass replace=True to change it")
        return pair

    def space(self, space_id: str) -> Space:
        record = self._load("spaces", space_id)
        if record is None:
            raise NotRegistered(f"code space {space_id!r} is not registered")
        return _space(record)

    def pair(self, pair_id: str) -> Pair:
        record = self._load("pairs", pair_id)
        if record is None:
            raise NotRegistered(f"pair {pair_id!r} is not registered; register the consumer's pair bundle first")
        return _pair(record)

    def resolve(self, pair_id: str, consumer_model_id: str) -> tuple[Pair, Space]:
        """The pair and its space for a consumer; :class:`NotRegistered` unless this consumer owns the pair."""
        pair = self.pair(pair_id)
        if pair.consumer_model_id != consumer_model_id:
            raise NotRegistered(f"consumer {consumer_model_id!r} is not registered for pair {pair_id!r} "
                                f"(registered consumer: {pair.consumer_model_id!r})")
        return pair, self.space(pair.space_id)

    def authorize_write(self, space_id: str, producer_model_id: str) -> Space:
        """The space, if ``producer_model_id`` is its producer; else :class:`NotAuthorized`."""
        space = self.space(space_id)
        if space.producer_model_id != producer_model_id:
            raise NotAuthorized(f"model {producer_model_id!r} may not write into space {space_id!r}: only its "
                                f"producer {space.producer_model_id!r} writes there (consumers never write)")
        return space

    def record_canary(self, space_id: str, engine: str, record: dict[str, Any]) -> None:
        """The hashing canary of ``space_id``'s producer under ``engine`` (replaces an older one)."""
        self._store("canaries", f"{space_id}|{engine}", record, True)

    def canaries(self, space_id: str) -> dict[str, dict[str, Any]]:
        """Every engine's canary recorded for ``space_id``, by engine name."""
        prefix = f"{space_id}|"
        return {k[len(prefix):]: v for k, v in self._all("canaries").items() if k.startswith(prefix)}

    def record_location(self, ident: str, path: str) -> None:
        """Where the bundle of a space (``ident`` = space id) or pair (pair id) lies (replaces an older one)."""
        self._store("locations", ident, {"path": path}, True)

    def locations(self) -> dict[str, str]:
        """Every recorded bundle directory, by space or pair id."""
        return {k: v["path"] for k, v in self._all("locations").items() if isinstance(v, dict) and "path" in v}

    def spaces(self) -> list[Space]:
        return [_space(r) for _, r in sorted(self._all("spaces").items())]

    def pairs(self) -> list[Pair]:
        return [_pair(r) for _, r in sorted(self._all("pairs").items())]


class FileRegistry(Registry):
    """A JSON file, rewritten atomically (temp file + rename) under an advisory lock."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _read(self) -> dict[str, dict[str, dict[str, Any]]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {kind: {} for kind in KINDS}
        except (OSError, ValueError) as exc:
            raise RegistryError(f"registry file {self.path} is unreadable: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("spaces"), dict) or not isinstance(
                data.get("pairs"), dict):
            raise RegistryError(f"registry file {self.path} is malformed (expected spaces and pairs objects)")
        for kind in KINDS:
            data.setdefault(kind, {})
        return data

    @contextlib.contextmanager
    def _locked(self):  # noqa: ANN202
        with open(self.path.with_suffix(self.path.suffix + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _load(self, kind: str, ident: str) -> dict[str, Any] | None:
        return self._read()[kind].get(ident)

    def _all(self, kind: str) -> dict[str, dict[str, Any]]:
        return self._read()[kind]

    def _store(self, kind: str, ident: str, record: dict[str, Any], replace: bool) -> dict[str, Any] | None:
        with self._locked():
            data = self._read()
            existing = data[kind].get(ident)
            if existing is not None and existing != record and not replace:
                return existing
            data[kind][ident] = record
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        return None


class RedisRegistry(Registry):
    """Two Redis hashes (``scd:__registry__:spaces`` / ``:pairs``) of JSON records."""

    def __init__(self, url: str, client: Any = None) -> None:
        from scd_store.store.redis_url import make_sync_client

        self.client = client if client is not None else make_sync_client(url)

    def _hash(self, kind: str) -> str:
        return {"spaces": REDIS_SPACES, "pairs": REDIS_PAIRS}.get(kind, f"{REDIS_PREFIX}:{kind}")

    def _load(self, kind: str, ident: str) -> dict[str, Any] | None:
        raw = self.client.hget(self._hash(kind), ident)
        return None if raw is None else json.loads(raw)

    def _all(self, kind: str) -> dict[str, dict[str, Any]]:
        return {k.decode() if isinstance(k, bytes) else k: json.loads(v)
                for k, v in self.client.hgetall(self._hash(kind)).items()}

    def _store(self, kind: str, ident: str, record: dict[str, Any], replace: bool) -> dict[str, Any] | None:
        payload = json.dumps(record, sort_keys=True)
        if replace:
            self.client.hset(self._hash(kind), ident, payload)
            return None
        if self.client.hsetnx(self._hash(kind), ident, payload):
            return None
        existing = self._load(kind, ident)
        return None if existing == record else existing

    def close(self) -> None:
        self.client.close()


def open_registry(redis_url: str | None = None, path: str | os.PathLike[str] | None = None) -> Registry:
    """Redis when ``redis_url`` is given, else the JSON file at ``path`` (default: data dir)."""
    if redis_url:
        return RedisRegistry(redis_url)
    if path is None:
        from scd_store.paths import data_dir

        path = data_dir() / "store" / "registry.json"
    return FileRegistry(path)
