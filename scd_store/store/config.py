"""One typed store configuration: defaults, then YAML, then ``SCD_STORE_*`` environment variables.

The embedded default is a CPU tier plus a local disk tier under ``scd_store.paths.data_dir()``:
no server needed. Byte sizes accept ints or strings such as ``"512MiB"`` / ``"2GB"``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from scd_store.errors import ScdStoreError
from scd_store.store.fs_safety import inside
from scd_store.store.keys import DEFAULT_CHUNK_SIZE, validate_chunk_size
from scd_store.store.redis_url import parse_redis_url

TIER_KINDS = ("gpu", "cpu", "peer", "disk", "redis")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ScdStoreError, ValueError):
    """An invalid store configuration."""


def parse_bytes(value: int | str) -> int:
    """``1048576``, ``"1MiB"``, ``"1.5GB"`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a byte size: {value!r} (use e.g. 1048576, '512MiB', '2GB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _default_disk_path() -> str:
    from scd_store.paths import data_dir

    return str(data_dir() / "store")


@dataclass(slots=True)
class TierConfig:
    """One tier. ``max_bytes`` bounds the in-memory and disk tiers (for Redis: the per-value limit is
    ``max_value_bytes``; ``max_bytes`` sets the server's maxmemory when ``apply_server_maxmemory``)."""

    kind: str
    max_bytes: int | str = "1GiB"
    path: str | None = None
    url: str | None = None
    ttl_s: float | None = None
    max_value_bytes: int | str = "64MiB"
    apply_server_maxmemory: bool = False
    pinned: bool = False
    fsync: bool = False
    rescan_s: float | None = 60.0
    publish: bool = True
    transfer: str = "auto"
    op_timeout_s: float | None = None
    queue_size: int = 256
    writers: int = 2

    def __post_init__(self) -> None:
        if self.kind not in TIER_KINDS:
            raise ConfigError(f"unknown tier kind {self.kind!r}; use one of {TIER_KINDS}")
        self.max_bytes = parse_bytes(self.max_bytes)
        self.max_value_bytes = parse_bytes(self.max_value_bytes)
        if self.max_bytes <= 0 or self.max_value_bytes <= 0:
            raise ConfigError(f"{self.kind} tier: max_bytes and max_value_bytes must be > 0")
        if self.kind == "disk" and self.path is None:
            self.path = _default_disk_path()
        if self.kind == "peer" and self.path is None and not self.url:
            self.path = str(Path(_default_disk_path()) / "peers")
        if self.kind == "redis":
            if not self.url:
                raise ConfigError("the redis tier needs a url (redis://, rediss://, redis+cluster://, "
                                  "redis+sentinel://)")
            parse_redis_url(self.url)
        if self.ttl_s is not None and float(self.ttl_s) <= 0:
            raise ConfigError(f"{self.kind} tier: ttl_s must be > 0 or null")
        if self.op_timeout_s is not None and float(self.op_timeout_s) <= 0:
            raise ConfigError(f"{self.kind} tier: op_timeout_s must be > 0 or null")
        if self.transfer not in ("auto", "nixl", "copy"):
            raise ConfigError(f"{self.kind} tier: transfer must be auto, nixl or copy, got {self.transfer!r}")
        if self.kind == "peer" and self.url:
            parse_redis_url(self.url)
        if self.rescan_s is not None and float(self.rescan_s) <= 0:
            raise ConfigError(f"{self.kind} tier: rescan_s must be > 0 or null")
        if self.queue_size <= 0 or self.writers <= 0:
            raise ConfigError(f"{self.kind} tier: queue_size and writers must be > 0")


def _default_tiers() -> tuple[TierConfig, ...]:
    return (TierConfig("cpu", max_bytes="1GiB"), TierConfig("disk", max_bytes="8GiB"))


@dataclass(slots=True)
class StoreConfig:
    """The store: ordered tiers (fastest first), chunking, timeouts, registry and stats wiring."""

    tiers: tuple[TierConfig, ...] = field(default_factory=_default_tiers)
    chunk_size: int = DEFAULT_CHUNK_SIZE
    op_timeout_s: float = 2.0
    put_timeout_s: float = 30.0
    retry_backoff_min_s: float = 0.1
    retry_backoff_max_s: float = 5.0
    registry_url: str | None = None
    registry_path: str | None = None
    stats_redis_url: str | None = None
    stats_path: str | None = None
    metrics_port: int | None = None
    raw_kv_bytes_per_token: int = 0
    signing_keys: str | None = None
    require_signed: bool = False
    allow_unsigned: bool = False
    registry_refresh_s: float = 2.0

    def __post_init__(self) -> None:
        self.tiers = tuple(t if isinstance(t, TierConfig) else TierConfig(**t) for t in self.tiers)
        if not self.tiers:
            raise ConfigError("the store needs at least one tier")
        kinds = [t.kind for t in self.tiers]
        order = [TIER_KINDS.index(k) for k in kinds]
        if order != sorted(order):
            raise ConfigError(f"tiers must be ordered fastest first (gpu, cpu, peer, disk, redis), got {kinds}")
        try:
            validate_chunk_size(self.chunk_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        for name in ("op_timeout_s", "put_timeout_s", "retry_backoff_min_s", "retry_backoff_max_s"):
            if float(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.retry_backoff_max_s < self.retry_backoff_min_s:
            raise ConfigError("retry_backoff_max_s must be >= retry_backoff_min_s")
        for name in ("registry_url", "stats_redis_url"):
            if getattr(self, name):
                parse_redis_url(getattr(self, name))
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port out of range: {self.metrics_port}")
        if self.raw_kv_bytes_per_token < 0:
            raise ConfigError("raw_kv_bytes_per_token must be >= 0")
        if self.signing_keys is not None and not Path(self.signing_keys).exists():
            raise ConfigError(f"signing_keys {self.signing_keys!r} does not exist (a key file or a directory of "
                              "<space_id>.keys files)")
        for name in ("require_signed", "allow_unsigned"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.require_signed and self.allow_unsigned:
            raise ConfigError("require_signed and allow_unsigned contradict each other: set one")
        for tier in self.tiers:
            if tier.kind == "disk" and self.registry_path and inside(self.registry_path, str(tier.path)):
                raise ConfigError(f"registry_path {self.registry_path} lies inside the disk tier {tier.path}: whoever "
                                  "can write blobs there could rewrite the registry; put it outside")
        if float(self.registry_refresh_s) < 0:
            raise ConfigError("registry_refresh_s must be >= 0 (0: never re-read the registry)")

    @property
    def redis_url(self) -> str | None:
        """The first Redis tier's URL (also the default for registry and stats)."""
        return next((t.url for t in self.tiers if t.kind == "redis"), None)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StoreConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown store config keys: {sorted(unknown)}")
        data = dict(data)
        if "tiers" in data:
            tiers = data["tiers"]
            if not isinstance(tiers, (list, tuple)):
                raise ConfigError("tiers must be a list")
            try:
                data["tiers"] = tuple(t if isinstance(t, TierConfig) else TierConfig(**t) for t in tiers)
            except TypeError as exc:
                raise ConfigError(f"bad tier entry: {exc}") from exc
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> StoreConfig:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the store config must be a mapping")
        return cls.from_dict(data.get("store", data))

    def with_env(self, env: Mapping[str, str]) -> StoreConfig:
        """Apply ``SCD_STORE_*`` overrides (see docs/store.md for the list)."""
        cfg = replace(self)
        if "SCD_STORE_TIERS" in env:
            kinds = [k.strip() for k in env["SCD_STORE_TIERS"].split(",") if k.strip()]
            by_kind = {t.kind: t for t in cfg.tiers}
            redis_url = env.get("SCD_STORE_REDIS_URL") or cfg.redis_url
            tiers = []
            for k in kinds:
                if k in by_kind:
                    tiers.append(by_kind[k])
                else:
                    tiers.append(TierConfig(k, url=redis_url if k == "redis" else None))
            cfg = replace(cfg, tiers=tuple(tiers))
        elif "SCD_STORE_REDIS_URL" in env and not any(t.kind == "redis" for t in cfg.tiers):
            cfg = replace(cfg, tiers=(*cfg.tiers, TierConfig("redis", url=env["SCD_STORE_REDIS_URL"])))
        tiers = list(cfg.tiers)
        for i, t in enumerate(tiers):
            prefix = f"SCD_STORE_{t.kind.upper()}_"
            updates: dict[str, Any] = {}
            for key, cast in (("MAX_BYTES", str), ("PATH", str), ("TTL_S", float), ("URL", str),
                              ("QUEUE_SIZE", int), ("MAX_VALUE_BYTES", str)):
                if prefix + key in env:
                    updates[key.lower()] = cast(env[prefix + key])
            if t.kind == "redis" and "SCD_STORE_REDIS_URL" in env:
                updates["url"] = env["SCD_STORE_REDIS_URL"]
            if updates:
                tiers[i] = replace(t, **updates)
        updates = {}
        for key, cast in (("CHUNK_SIZE", int), ("OP_TIMEOUT_S", float), ("PUT_TIMEOUT_S", float),
                          ("REGISTRY_URL", str), ("REGISTRY_PATH", str), ("STATS_REDIS_URL", str), ("STATS_PATH", str),
                          ("METRICS_PORT", int), ("RAW_KV_BYTES_PER_TOKEN", int), ("SIGNING_KEYS", str),
                          ("REQUIRE_SIGNED", _flag), ("ALLOW_UNSIGNED", _flag), ("REGISTRY_REFRESH_S", float)):
            if "SCD_STORE_" + key in env:
                try:
                    updates[key.lower()] = cast(env["SCD_STORE_" + key])
                except ValueError as exc:
                    raise ConfigError(f"SCD_STORE_{key}: {exc}") from exc
        return replace(cfg, tiers=tuple(tiers), **updates)


def _flag(text: str) -> bool:
    if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes")


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> StoreConfig:
    """Defaults, then the YAML at ``path`` (or ``$SCD_STORE_CONFIG``), then ``SCD_STORE_*`` variables."""
    env = os.environ if env is None else env
    path = path or env.get("SCD_STORE_CONFIG")
    base = StoreConfig.from_yaml(path) if path else StoreConfig()
    return base.with_env(env)
