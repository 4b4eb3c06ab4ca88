"""The store's branch of the configuration tree: :class:`StoreConfig` and its :class:`TierConfig` tiers.

An engine's :class:`~scd_store.service.settings.EngineSettings` names the YAML; :func:`load_config`
reads defaults (:mod:`scd_store.store.defaults`), then that YAML, then the environment variables of
:data:`STORE_ENV` and :data:`TIER_ENV` (plus :data:`CONFIG_ENV`, :data:`TIERS_ENV`), each named
literally here and listed in docs/configuration.md; :func:`scd_store.store.build.open_store` hands
every value to the tiers and the :class:`~scd_store.store.tiered.TieredStore`.

The embedded default is a CPU tier plus a local disk tier under ``scd_store.paths.data_dir()``:
no server needed. Byte sizes accept ints or strings such as ``"512MiB"`` / ``"2GB"``; booleans
follow :func:`scd_store.flags.parse_flag` wherever they come from.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from scd_store.errors import ScdStoreError
from scd_store.flags import parse_flag
from scd_store.store import defaults
from scd_store.store.fs_safety import inside
from scd_store.store.keys import validate_chunk_size
from scd_store.store.redis_url import parse_redis_url

TIER_KINDS = ("gpu", "cpu", "peer", "disk", "redis")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

CONFIG_ENV = "SCD_STORE_CONFIG"  # the YAML file
TIERS_ENV = "SCD_STORE_TIERS"  # comma-separated tier kinds, replacing the YAML's list
REDIS_URL_ENV = "SCD_STORE_REDIS_URL"  # the redis tier's url; adds a redis tier when there is none
STORE_ENV: dict[str, str] = {  # variable -> StoreConfig field
    "SCD_STORE_CHUNK_SIZE": "chunk_size",
    "SCD_STORE_OP_TIMEOUT_S": "op_timeout_s",
    "SCD_STORE_PUT_TIMEOUT_S": "put_timeout_s",
    "SCD_STORE_REGISTRY_URL": "registry_url",
    "SCD_STORE_REGISTRY_PATH": "registry_path",
    "SCD_STORE_STATS_REDIS_URL": "stats_redis_url",
    "SCD_STORE_STATS_PATH": "stats_path",
    "SCD_STORE_METRICS_PORT": "metrics_port",
    "SCD_STORE_RAW_KV_BYTES_PER_TOKEN": "raw_kv_bytes_per_token",
    "SCD_STORE_SIGNING_KEYS": "signing_keys",
    "SCD_STORE_REQUIRE_SIGNED": "require_signed",
    "SCD_STORE_ALLOW_UNSIGNED": "allow_unsigned",
    "SCD_STORE_REGISTRY_REFRESH_S": "registry_refresh_s",
    "SCD_STORE_REPAIR_S": "repair_s",
    "SCD_STORE_REPAIR_RATE": "repair_rate",
    "SCD_STORE_STATS_FLUSH_S": "stats_flush_s",
}
_COMMON = ("max_bytes", "op_timeout_s", "queue_size", "writers")
TIER_FIELDS: dict[str, tuple[str, ...]] = {  # the TierConfig fields each kind takes; setting another is an error
    "gpu": _COMMON,
    "cpu": (*_COMMON, "pinned"),
    "peer": (*_COMMON, "path", "url", "publish", "transfer", "max_value_bytes"),
    "disk": (*_COMMON, "path", "fsync", "rescan_s", "max_value_bytes"),
    "redis": (*_COMMON, "url", "ttl_s", "max_value_bytes", "apply_server_maxmemory", "max_lifetime_s"),
}
# variable -> (tier kind, TierConfig field), for every tier of that kind: one per setting of the kind among
# max_bytes, path, ttl_s, url, queue_size, max_value_bytes and max_lifetime_s (a test holds it to TIER_FIELDS)
TIER_ENV: dict[str, tuple[str, str]] = {
    "SCD_STORE_GPU_MAX_BYTES": ("gpu", "max_bytes"),
    "SCD_STORE_GPU_QUEUE_SIZE": ("gpu", "queue_size"),
    "SCD_STORE_CPU_MAX_BYTES": ("cpu", "max_bytes"),
    "SCD_STORE_CPU_QUEUE_SIZE": ("cpu", "queue_size"),
    "SCD_STORE_PEER_MAX_BYTES": ("peer", "max_bytes"),
    "SCD_STORE_PEER_PATH": ("peer", "path"),
    "SCD_STORE_PEER_URL": ("peer", "url"),
    "SCD_STORE_PEER_QUEUE_SIZE": ("peer", "queue_size"),
    "SCD_STORE_PEER_MAX_VALUE_BYTES": ("peer", "max_value_bytes"),
    "SCD_STORE_DISK_MAX_BYTES": ("disk", "max_bytes"),
    "SCD_STORE_DISK_PATH": ("disk", "path"),
    "SCD_STORE_DISK_QUEUE_SIZE": ("disk", "queue_size"),
    "SCD_STORE_DISK_MAX_VALUE_BYTES": ("disk", "max_value_bytes"),
    "SCD_STORE_REDIS_MAX_BYTES": ("redis", "max_bytes"),
    "SCD_STORE_REDIS_TTL_S": ("redis", "ttl_s"),
    REDIS_URL_ENV: ("redis", "url"),
    "SCD_STORE_REDIS_QUEUE_SIZE": ("redis", "queue_size"),
    "SCD_STORE_REDIS_MAX_VALUE_BYTES": ("redis", "max_value_bytes"),
    "SCD_STORE_REDIS_MAX_LIFETIME_S": ("redis", "max_lifetime_s"),
}


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


def _bool(value: Any, name: str) -> bool:
    """:func:`~scd_store.flags.parse_flag`, failing as a :class:`ConfigError`."""
    try:
        return parse_flag(value, name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


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
    max_lifetime_s: float | None = None
    queue_size: int = defaults.QUEUE_SIZE
    writers: int = defaults.WRITERS

    def __post_init__(self) -> None:
        if self.kind not in TIER_KINDS:
            raise ConfigError(f"unknown tier kind {self.kind!r}; use one of {TIER_KINDS}")
        for name in ("apply_server_maxmemory", "pinned", "fsync", "publish"):
            setattr(self, name, _bool(getattr(self, name), f"{self.kind} tier: {name}"))
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
        if self.max_lifetime_s is not None and (self.kind != "redis" or self.ttl_s is None
                                                or float(self.max_lifetime_s) < float(self.ttl_s)):
            raise ConfigError(f"{self.kind} tier: max_lifetime_s is a redis tier's, with a ttl_s no longer than it")
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
        for spec in fields(self):  # after normalising: a byte size or a flag given as text is still its default
            default = parse_bytes(spec.default) if spec.name == "max_value_bytes" else spec.default
            if spec.name != "kind" and spec.name not in TIER_FIELDS[self.kind] and getattr(self, spec.name) != default:
                raise ConfigError(f"{self.kind} tier: {spec.name} is not a {self.kind} tier's setting (it takes "
                                  f"{', '.join(TIER_FIELDS[self.kind])})")


def _default_tiers() -> tuple[TierConfig, ...]:
    return (TierConfig("cpu", max_bytes="1GiB"), TierConfig("disk", max_bytes="8GiB"))


@dataclass(slots=True)
class StoreConfig:
    """The store: ordered tiers (fastest first), chunking, timeouts, registry, repair and stats wiring."""

    tiers: tuple[TierConfig, ...] = field(default_factory=_default_tiers)
    chunk_size: int = defaults.CHUNK_SIZE
    op_timeout_s: float = defaults.OP_TIMEOUT_S
    put_timeout_s: float = defaults.PUT_TIMEOUT_S
    retry_backoff_min_s: float = defaults.BACKOFF_MIN_S
    retry_backoff_max_s: float = defaults.BACKOFF_MAX_S
    registry_url: str | None = None
    registry_path: str | None = None
    stats_redis_url: str | None = None
    stats_path: str | None = None
    metrics_port: int | None = None
    raw_kv_bytes_per_token: int = 0
    signing_keys: str | None = None
    require_signed: bool = False
    allow_unsigned: bool = False
    registry_refresh_s: float = defaults.REGISTRY_REFRESH_S
    repair_s: float = defaults.REPAIR_S
    repair_rate: float = defaults.REPAIR_RATE
    stats_flush_s: float = defaults.STATS_FLUSH_S

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
        for name in ("op_timeout_s", "put_timeout_s", "retry_backoff_min_s", "retry_backoff_max_s", "stats_flush_s",
                     "repair_rate"):
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
        self.require_signed = _bool(self.require_signed, "require_signed")
        self.allow_unsigned = _bool(self.allow_unsigned, "allow_unsigned")
        if self.require_signed and self.allow_unsigned:
            raise ConfigError("require_signed and allow_unsigned contradict each other: set one")
        for tier in self.tiers:
            if tier.kind == "disk" and self.registry_path and inside(self.registry_path, str(tier.path)):
                raise ConfigError(f"registry_path {self.registry_path} lies inside the disk tier {tier.path}: whoever "
                                  "can write blobs there could rewrite the registry; put it outside")
        if float(self.registry_refresh_s) < 0:
            raise ConfigError("registry_refresh_s must be >= 0 (0: never re-read the registry)")
        if float(self.repair_s) < 0:
            raise ConfigError("repair_s must be >= 0 (0: never take readers' reports)")

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
        """Apply the variables: :data:`TIERS_ENV` / :data:`REDIS_URL_ENV` choose the tiers, then
        :data:`TIER_ENV` and :data:`STORE_ENV` set fields (docs/configuration.md lists them all)."""
        cfg = replace(self)
        if TIERS_ENV in env:
            kinds = [k.strip() for k in env[TIERS_ENV].split(",") if k.strip()]
            by_kind = {t.kind: t for t in cfg.tiers}
            redis_url = env.get(REDIS_URL_ENV) or cfg.redis_url
            cfg = replace(cfg, tiers=tuple(by_kind[k] if k in by_kind else
                                           TierConfig(k, url=redis_url if k == "redis" else None) for k in kinds))
        elif REDIS_URL_ENV in env and not any(t.kind == "redis" for t in cfg.tiers):
            cfg = replace(cfg, tiers=(*cfg.tiers, TierConfig("redis", url=env[REDIS_URL_ENV])))
        per_kind: dict[str, dict[str, Any]] = {}
        for name, (kind, key) in TIER_ENV.items():
            if name in env:
                per_kind.setdefault(kind, {})[key] = _env_value(TierConfig, key, name, env[name])
        tiers = tuple(replace(t, **per_kind[t.kind]) if t.kind in per_kind else t for t in cfg.tiers)
        updates = {key: _env_value(StoreConfig, key, name, env[name]) for name, key in STORE_ENV.items() if name in env}
        return replace(cfg, tiers=tiers, **updates)


def _env_value(cls: type, key: str, name: str, text: str) -> Any:
    """The text of variable ``name`` as a value of ``cls``'s field ``key``, cast by the field's type: a bool
    by :func:`~scd_store.flags.parse_flag`, a field that takes text as given, else an int or a float."""
    kinds = {part.strip() for part in str(next(f.type for f in fields(cls) if f.name == key)).split("|")} - {"None"}
    if kinds == {"bool"}:
        return _bool(text, name)
    if "str" in kinds:
        return text
    try:
        return int(text) if kinds == {"int"} else float(text)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from exc


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> StoreConfig:
    """Defaults, then the YAML at ``path`` (or ``$SCD_STORE_CONFIG``), then the ``SCD_STORE_*`` variables."""
    env = os.environ if env is None else env
    path = path or env.get(CONFIG_ENV)
    base = StoreConfig.from_yaml(path) if path else StoreConfig()
    return base.with_env(env)
