"""Registry of code spaces and pairs: in Redis when configured, else a local JSON file.

A space generation is written by exactly one producer model; a pair maps a consumer model to one
space generation. A consumer that is not registered for a space gets :class:`NotRegistered`, never
codes. Several generations of a space coexist (a rollout: :mod:`scd_store.store.records`); an
operator revokes one with :meth:`Registry.revoke`. Every change of a space or pair bumps
:meth:`Registry.version`, which stores re-read within ``registry_refresh_s`` (revocation takes
effect there). A space's producer also records its engine's hashing canary, so consumers can check
they hash alike: in Redis one hash per space (``scd:__registry__:canaries:{space_id}``), which only that
space's producer user may write (:mod:`scd_store.store.redis_acl`), so no producer can make another
space's consumers refuse their lookups. A :class:`FileRegistry` lives in a directory only this user may
write, and its file is refused when other users may write it (:mod:`scd_store.store.fs_safety`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from abc import ABC, abstractmethod
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scd_store.store import strict_json
from scd_store.store.fs_safety import UnsafePath, check_owner_only, private_dir
from scd_store.store.keys import generation_of, validate_space_id
from scd_store.store.records import NotAuthorized, NotRegistered, Pair, RegistryError, Space

__all__ = ["FileRegistry", "NotAuthorized", "NotRegistered", "Pair", "RedisRegistry", "Registry", "RegistryError",
           "Space", "open_registry"]

REDIS_PREFIX = "scd:__registry__"
REDIS_SPACES = f"{REDIS_PREFIX}:spaces"
REDIS_PAIRS = f"{REDIS_PREFIX}:pairs"
REDIS_VERSION = f"{REDIS_PREFIX}:version"
REDIS_CANARIES = f"{REDIS_PREFIX}:canaries"  # + ":{space_id}": that space's canaries, engine -> JSON record
# canaries: each space's producer hashing, per engine; locations: the bundle directory of a space or pair
KINDS = ("spaces", "pairs", "canaries", "locations")
VERSIONED = ("spaces", "pairs")  # kinds whose changes bump the version


def _record(cls: type, obj: Any) -> Any:
    """A space or pair from its stored JSON; a record that does not parse is as good as absent (never guessed)."""
    try:
        if not isinstance(obj, dict):
            raise TypeError(f"expected an object, got {type(obj).__name__}")
        return cls(**obj)
    except (TypeError, ValueError) as exc:
        raise NotRegistered(f"a malformed {cls.__name__.lower()} record in the registry: {exc}") from None


def _loads(raw: Any) -> dict[str, Any] | None:
    """A stored record's JSON object, or None when it is none (junk is as good as absent)."""
    try:
        obj = strict_json.loads(raw)
    except (ValueError, TypeError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _space(obj: dict[str, Any]) -> Space:
    return _record(Space, obj)


def _pair(obj: dict[str, Any]) -> Pair:
    return _record(Pair, obj)


class Registry(ABC):
    """Spaces and pairs. ``register_*`` is idempotent for an identical record and refuses a different one
    of the same generation unless ``replace=True``; another generation is a record of its own."""

    @abstractmethod
    def _load(self, kind: str, ident: str) -> dict[str, Any] | None: ...

    @abstractmethod
    def _store(self, kind: str, ident: str, record: dict[str, Any], replace: bool) -> dict[str, Any] | None:
        """Write ``record`` (bumping the version when it changed a versioned kind); return the existing
        different record instead when one exists and not ``replace``."""

    @abstractmethod
    def _delete(self, kind: str, idents: list[str]) -> int:
        """Remove records (bumping the version when a versioned kind changed); returns how many were removed."""

    @abstractmethod
    def _all(self, kind: str) -> dict[str, dict[str, Any]]: ...

    @abstractmethod
    def _bump_version(self) -> None:
        """Bump the version whatever changed (a revocation that removed nothing now may have removed it before
        a failed bump: stores must re-read)."""

    @abstractmethod
    def version(self) -> int:
        """A counter bumped by every change of a space or pair record (0 for a new registry)."""

    def register_space(self, space: Space, *, replace: bool = False) -> Space:
        existing = self._store("spaces", space.ident, asdict(space), replace)
        if existing is not None:
            raise RegistryError(f"space {space.space_id!r} generation {space.generation} is already registered with "
                                f"different contents (producer {existing.get('producer_model_id')!r}); pass "
                                "replace=True to change it")
        return space

    def register_pair(self, pair: Pair, *, replace: bool = False) -> Pair:
        self.space(pair.space_id, pair.space_fingerprint)
        existing = self._store("pairs", pair.ident, asdict(pair), replace)
        if existing is not None:
            raise RegistryError(f"pair {pair.pair_id!r} is already registered with different contents "
                                f"(decoder {existing.get('bundle_fingerprint')!r}); pass replace=True to change it")
        return pair

    def space(self, space_id: str, fingerprint: str) -> Space:
        """The generation of ``space_id`` whose blobs carry ``fingerprint``."""
        record = self._load("spaces", f"{space_id}@{generation_of(fingerprint)}")
        if record is None:
            raise NotRegistered(f"code space {space_id!r} (fingerprint {fingerprint}) is not registered")
        return _space(record)

    def pair(self, pair_id: str, space_fingerprint: str) -> Pair:
        record = self._load("pairs", f"{pair_id}@{generation_of(space_fingerprint)}")
        if record is None:
            raise NotRegistered(f"pair {pair_id!r} (space fingerprint {space_fingerprint}) is not registered; "
                                "register the consumer's pair bundle first")
        return _pair(record)

    def resolve(self, pair_id: str, consumer_model_id: str, space_fingerprint: str) -> tuple[Pair, Space]:
        """The pair and its space generation for a consumer; :class:`NotRegistered` unless this consumer
        owns the pair."""
        pair = self.pair(pair_id, space_fingerprint)
        if pair.consumer_model_id != consumer_model_id:
            raise NotRegistered(f"consumer {consumer_model_id!r} is not registered for pair {pair_id!r} "
                                f"(registered consumer: {pair.consumer_model_id!r})")
        return pair, self.space(pair.space_id, pair.space_fingerprint)

    def authorize_write(self, space_id: str, producer_model_id: str, fingerprint: str) -> Space:
        """The space generation, if ``producer_model_id`` is its producer; else :class:`NotAuthorized`."""
        space = self.space(space_id, fingerprint)
        if space.producer_model_id != producer_model_id:
            raise NotAuthorized(f"model {producer_model_id!r} may not write into space {space_id!r}: only its "
                                f"producer {space.producer_model_id!r} writes there (consumers never write)")
        return space

    def revoke(self, ident: str, fingerprint: str | None = None) -> list[str]:
        """Remove a space (every pair of it too) or a pair, by id; only the generation of ``fingerprint``
        when given. Returns the removed record names; engines stop serving them within their
        ``registry_refresh_s``."""
        generation = None if fingerprint is None else generation_of(fingerprint)

        def chosen(name: str) -> bool:
            base, _, gen = name.rpartition("@")
            return base == ident and generation in (None, gen)

        spaces = {n: _space(r) for n, r in self._all("spaces").items() if chosen(n)}
        revoked_fps = {s.fingerprint for s in spaces.values()}
        pairs = [n for n, r in self._all("pairs").items()
                 if chosen(n) or (r.get("space_id") == ident and r.get("space_fingerprint") in revoked_fps)]
        removed = [*spaces, *pairs]
        if pairs:
            self._delete("pairs", pairs)
        if spaces:
            self._delete("spaces", list(spaces))
        self._delete("locations", [n for n in self._all("locations") if n in removed])
        self._bump_version()  # also when a retry finds nothing left: its first bump may have failed
        return removed

    def record_canary(self, space_id: str, engine: str, record: dict[str, Any]) -> None:
        """The hashing canary of ``space_id``'s producer under ``engine`` (replaces an older one)."""
        self._store("canaries", f"{space_id}|{engine}", record, True)

    def canaries(self, space_id: str) -> dict[str, dict[str, Any]]:
        """Every engine's canary recorded for ``space_id``, by engine name."""
        prefix = f"{space_id}|"
        return {k[len(prefix):]: v for k, v in self._all("canaries").items() if k.startswith(prefix)}

    def record_location(self, ident: str, path: str) -> None:
        """Where the bundle of a space or pair record (its ``ident``) lies (replaces an older one)."""
        self._store("locations", ident, {"path": path}, True)

    def locations(self) -> dict[str, str]:
        """Every recorded bundle directory, by space or pair record name (``ident``)."""
        return {k: v["path"] for k, v in self._all("locations").items() if isinstance(v, dict) and "path" in v}

    def spaces(self) -> list[Space]:
        """Every registered space generation."""
        return [_space(r) for _, r in sorted(self._all("spaces").items())]

    def pairs(self) -> list[Pair]:
        """Every registered pair (each names its space generation)."""
        return [_pair(r) for _, r in sorted(self._all("pairs").items())]


class FileRegistry(Registry):
    """A JSON file, rewritten atomically (temp file + rename) under an advisory lock."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        private_dir(self.path.parent, "the registry directory")  # 0700; UnsafePath when others may write it
        with contextlib.suppress(FileNotFoundError):
            self._raw()  # a file other users may write is refused at once

    def _raw(self) -> bytes:
        """The file's bytes; :class:`~scd_store.store.fs_safety.UnsafePath` when group or others may write it."""
        with open(self.path, "rb") as f:
            check_owner_only(self.path, os.fstat(f.fileno()), "the registry file")
            return f.read()

    def _read(self) -> dict[str, dict[str, dict[str, Any]]]:
        try:
            data = strict_json.loads(self._raw())
        except FileNotFoundError:
            return {kind: {} for kind in KINDS}
        except UnsafePath:
            raise
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
        return _current(kind, self._read()[kind])

    def version(self) -> int:
        return int(self._read().get("version", 0))

    def _write(self, data: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _store(self, kind: str, ident: str, record: dict[str, Any], replace: bool) -> dict[str, Any] | None:
        with self._locked():
            data = self._read()
            existing = data[kind].get(ident)
            if existing == record:
                return None
            if existing is not None and not replace:
                return existing
            data[kind][ident] = record
            if kind in VERSIONED:
                data["version"] = int(data.get("version", 0)) + 1
            self._write(data)
        return None

    def _bump_version(self) -> None:
        with self._locked():
            data = self._read()
            data["version"] = int(data.get("version", 0)) + 1
            self._write(data)

    def _delete(self, kind: str, idents: list[str]) -> int:
        with self._locked():
            data = self._read()
            removed = [i for i in idents if data[kind].pop(i, None) is not None]
            if removed:
                if kind in VERSIONED:
                    data["version"] = int(data.get("version", 0)) + 1
                self._write(data)
        return len(removed)


class RedisRegistry(Registry):
    """Redis hashes of JSON records: ``scd:__registry__:spaces`` / ``:pairs`` / ``:locations``, and one
    ``scd:__registry__:canaries:{space_id}`` per space."""

    def __init__(self, url: str, client: Any = None) -> None:
        from scd_store.store.redis_url import make_sync_client

        self.client = client if client is not None else make_sync_client(url)

    def _hash(self, kind: str) -> str:
        return {"spaces": REDIS_SPACES, "pairs": REDIS_PAIRS}.get(kind, f"{REDIS_PREFIX}:{kind}")

    def _load(self, kind: str, ident: str) -> dict[str, Any] | None:
        raw = self.client.hget(self._hash(kind), ident)
        return None if raw is None else _loads(raw)

    def _all(self, kind: str) -> dict[str, dict[str, Any]]:
        loaded = {k.decode() if isinstance(k, bytes) else k: _loads(v)
                  for k, v in self.client.hgetall(self._hash(kind)).items()}
        return _current(kind, {k: v for k, v in loaded.items() if v is not None})

    def version(self) -> int:
        return int(self.client.get(REDIS_VERSION) or 0)

    def _bump(self, kind: str) -> None:
        if kind in VERSIONED:
            self.client.incr(REDIS_VERSION)

    def _bump_version(self) -> None:
        self.client.incr(REDIS_VERSION)

    def _store(self, kind: str, ident: str, record: dict[str, Any], replace: bool) -> dict[str, Any] | None:
        payload = json.dumps(record, sort_keys=True)
        if not replace and not self.client.hsetnx(self._hash(kind), ident, payload):
            existing = self._load(kind, ident)
            return None if existing == record else existing
        if replace and self._load(kind, ident) == record:
            return None
        if replace:
            self.client.hset(self._hash(kind), ident, payload)
        self._bump(kind)
        return None

    def _delete(self, kind: str, idents: list[str]) -> int:
        removed = int(self.client.hdel(self._hash(kind), *idents)) if idents else 0
        if removed:
            self._bump(kind)
        return removed

    def record_canary(self, space_id: str, engine: str, record: dict[str, Any]) -> None:
        """The canary of ``space_id``'s producer under ``engine``, in that space's own hash (which only its
        producer user may write)."""
        self.client.hset(_canary_key(space_id), engine, json.dumps(record, sort_keys=True))

    def canaries(self, space_id: str) -> dict[str, dict[str, Any]]:
        """Every engine's canary in ``space_id``'s own hash (records that are no JSON object are skipped)."""
        found: dict[str, dict[str, Any]] = {}
        for engine, raw in self.client.hgetall(_canary_key(space_id)).items():
            try:
                record = strict_json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict):
                found[engine.decode(errors="replace") if isinstance(engine, bytes) else engine] = record
        return found

    def close(self) -> None:
        self.client.close()


def _canary_key(space_id: str) -> str:
    return f"{REDIS_CANARIES}:{validate_space_id(space_id)}"


def _current(kind: str, records: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Records of this registry format (space and pair names carry their generation: ``id@v2.<hash>``);
    records an older scd-store wrote are left out (register the bundle again)."""
    if kind not in VERSIONED:
        return records
    return {k: v for k, v in records.items() if "@" in k}


def open_registry(redis_url: str | None = None, path: str | os.PathLike[str] | None = None) -> Registry:
    """Redis when ``redis_url`` is given, else the JSON file at ``path`` (default: data dir)."""
    if redis_url:
        return RedisRegistry(redis_url)
    if path is None:
        from scd_store.paths import data_dir

        path = data_dir() / "registry" / "registry.json"  # outside every tier's root
    return FileRegistry(path)
