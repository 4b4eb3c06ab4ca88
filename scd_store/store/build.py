"""Build a :class:`TieredStore` (tiers, registry, keyring, stats wiring) from a :class:`StoreConfig`.

:func:`open_store` is where the store's branch of the configuration tree is handed down: every
:class:`StoreConfig` value goes to :class:`TieredStore` or to a tier (:func:`build_tier`) from here, and
nothing here reads a setting from the environment itself (``SCD_STORE_SIGNING_KEY`` and
``SCD_STORE_SIGNING_KEYS`` are read by :meth:`~scd_store.store.signing.Keyring.from_env`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from scd_store.store.config import ConfigError, StoreConfig, TierConfig, load_config
from scd_store.store.host_keys import host_keyring
from scd_store.store.keyring import Keyring
from scd_store.store.registry import FileRegistry, RedisRegistry, Registry
from scd_store.store.stats import StoreStats
from scd_store.store.stats_sinks import NoSink, RedisStatsMirror, SnapshotFiles, StatsSink
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.base import Tier

log = logging.getLogger("scd_store.store")


def build_tier(cfg: TierConfig, store_timeout_s: float | None = None) -> Tier | None:
    """One tier from its config; None for a GPU tier without CUDA (logged). A Redis tier's socket timeout
    is its deadline per operation (the tier's ``op_timeout_s``, else ``store_timeout_s``, else 2 s), so a
    longer deadline is not cut short by the client."""
    if cfg.kind == "cpu":
        from scd_store.store.tiers.cpu import CpuTier

        return CpuTier(int(cfg.max_bytes), pinned=cfg.pinned)
    if cfg.kind == "disk":
        from scd_store.store.tiers.disk import DiskTier

        return DiskTier(str(cfg.path), int(cfg.max_bytes), fsync=cfg.fsync,
                        rescan_s=float(cfg.rescan_s) if cfg.rescan_s is not None else None,
                        max_value_bytes=int(cfg.max_value_bytes))
    if cfg.kind == "peer":
        from scd_store.store.tiers.peer import PeerTier
        from scd_store.store.transfer.directory import directory_for

        timeout = {"read_timeout_s": float(cfg.op_timeout_s)} if cfg.op_timeout_s is not None else {}
        return PeerTier(directory_for(cfg.url, cfg.path), publish_bytes=int(cfg.max_bytes) if cfg.publish else 0,
                        transfer=cfg.transfer, max_value_bytes=int(cfg.max_value_bytes), **timeout)
    if cfg.kind == "redis":
        from scd_store.store.tiers.redis_tier import RedisTier

        deadline = cfg.op_timeout_s if cfg.op_timeout_s is not None else store_timeout_s
        socket = {"socket_timeout": float(deadline)} if deadline is not None else {}
        return RedisTier(str(cfg.url), ttl_s=cfg.ttl_s, max_value_bytes=int(cfg.max_value_bytes),
                         server_maxmemory=int(cfg.max_bytes) if cfg.apply_server_maxmemory else None,
                         max_lifetime_s=cfg.max_lifetime_s, **socket)
    import torch

    if not torch.cuda.is_available():
        log.warning("store config lists a gpu tier but CUDA is not available: skipping it")
        return None
    from scd_store.store.tiers.gpu import GpuTier

    return GpuTier(int(cfg.max_bytes))


SHARED_KINDS = ("disk", "peer", "redis")  # tiers more than one process reads: their blobs must be signed


def open_registry_for(config: StoreConfig) -> Registry:
    url = config.registry_url or config.redis_url
    if url:
        return RedisRegistry(url)
    if config.registry_path:
        return FileRegistry(config.registry_path)
    from scd_store.paths import data_dir

    return FileRegistry(data_dir() / "registry" / "registry.json")  # outside every tier's root


def stats_dir() -> Path:
    """Where processes without Redis write their stats snapshots (``<data dir>/stats``)."""
    from scd_store.paths import data_dir

    return Path(data_dir()) / "stats"


def stats_sink_for(config: StoreConfig) -> StatsSink:
    """Redis when the config names one (``stats_redis_url`` or the Redis tier), else per-process files."""
    url = config.stats_redis_url or config.redis_url
    return RedisStatsMirror(url) if url else SnapshotFiles(config.stats_path or stats_dir())


def keyring_for(config: StoreConfig, env: Mapping[str, str] | None = None, stats: StoreStats | None = None
                ) -> Keyring | None:
    """The keyring of ``config`` (``signing_keys``, ``SCD_STORE_SIGNING_KEY(S)``). Without one, blobs of tiers
    several processes share must still be signed: tiers of this host only (disk) use the host keyring
    (:mod:`scd_store.store.host_keys`); tiers other hosts reach (Redis, peers) are an error unless the
    operator opts out with ``allow_unsigned`` (a warning). ``require_signed`` asks for configured keys always."""
    on_error = (lambda _message: stats.inc("keyring_errors")) if stats is not None else None
    keyring = Keyring.from_env(config.signing_keys, os.environ if env is None else env)
    if keyring is not None:
        keyring.on_error = on_error
        return keyring
    if config.require_signed:
        raise ConfigError("require_signed is set but no signing keys are configured (signing_keys, "
                          "SCD_STORE_SIGNING_KEYS or SCD_STORE_SIGNING_KEY; make them with `scd-store keys new`)")
    shared = [t.kind for t in config.tiers if t.kind in SHARED_KINDS]
    if not shared:
        return None
    if config.allow_unsigned:
        log.warning("scd-store: allow_unsigned: the %s tier(s) are shared by several processes and their blobs are "
                    "unsigned, so whoever can write to them can plant codes readers decode (docs/reliability.md)",
                    "/".join(shared))
        return None
    remote = [k for k in shared if k != "disk"]
    if remote:
        raise ConfigError(f"the {'/'.join(remote)} tier is shared with other processes and hosts, so its blobs must "
                          "be signed: make keys with `scd-store keys new` and set signing_keys (producers: the "
                          "private file, readers: the public one), or opt out with allow_unsigned: true")
    from scd_store.paths import data_dir

    return host_keyring(data_dir() / "keys", on_error=on_error)


def open_store(config: StoreConfig | None = None, *, registry: Registry | None = None,
               stats: StoreStats | None = None, share_stats: bool = True) -> TieredStore:
    """The store described by ``config`` (default: :func:`load_config`, i.e. CPU + local disk); with
    ``share_stats=False`` this process's counters stay out of the deployment's (a reading tool)."""
    config = config if config is not None else load_config()
    built = [(cfg, build_tier(cfg, config.op_timeout_s)) for cfg in config.tiers]
    pairs = [(cfg, tier) for cfg, tier in built if tier is not None]
    stats = stats if stats is not None else StoreStats()
    if config.metrics_port is not None:
        try:
            stats.serve_http(config.metrics_port)
        except OSError as exc:  # e.g. a second engine process on this host with the same config
            log.warning("scd-store: cannot serve metrics on port %d (%s): this process serves none; give each "
                        "process on a host its own metrics_port (SCD_STORE_METRICS_PORT)", config.metrics_port, exc)
    sink = stats_sink_for(config) if share_stats else NoSink()
    return TieredStore([t for _, t in pairs], registry if registry is not None else open_registry_for(config),
                       chunk_size=config.chunk_size, stats=stats, op_timeout_s=config.op_timeout_s,
                       put_timeout_s=config.put_timeout_s, queue_size=[c.queue_size for c, _ in pairs],
                       writers=[c.writers for c, _ in pairs], backoff_min_s=config.retry_backoff_min_s,
                       backoff_max_s=config.retry_backoff_max_s,
                       stats_sink=sink, keyring=keyring_for(config, stats=stats),
                       registry_refresh_s=config.registry_refresh_s, repair_s=config.repair_s,
                       repair_rate=config.repair_rate,
                       stats_flush_s=config.stats_flush_s,
                       tier_timeouts={t.name: float(c.op_timeout_s) for c, t in pairs if c.op_timeout_s is not None})
