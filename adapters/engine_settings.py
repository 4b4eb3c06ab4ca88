"""What an engine adapter needs from its engine's config, and one shared :class:`KVService` per process.

Both the LMCache plugin and the SGLang backend read the same keys (LMCache: ``extra_config``
``scd.*``; SGLang: the ``--hicache-storage-backend-extra-config`` JSON without the prefix):

- ``bundles``: calibration bundle directories (a list, or one string of comma-separated paths);
- ``store_config``: an scd-store YAML (default: ``$SCD_STORE_CONFIG`` or the embedded CPU + disk);
- ``aliases``: ``{engine model name: bundle model name}``;
- ``positions``: where a stored chunk's absolute position comes from. ``connector`` (default):
  from the engine (LMCache: ``MemoryObj.metadata.cached_positions``; SGLang: ``prefix_keys``);
  chunks without one are not stored. ``batch``: when the engine gives none, a put batch is taken
  to start at position 0 (right only for engines that store whole prompts).

Engines in one process that name the same store config and bundles share one store and service.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scd_store.store.build import open_store
from scd_store.store.config import load_config
from scd_store.store.service import KVService

POSITION_MODES = ("connector", "batch")


class SettingsError(ValueError):
    """A bad scd-store section in an engine's configuration."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """scd-store's keys in an engine config, validated."""

    bundles: tuple[str, ...]
    store_config: str | None = None
    aliases: tuple[tuple[str, str], ...] = field(default=())
    positions: str = "connector"

    def __post_init__(self) -> None:
        if not self.bundles:
            raise SettingsError("scd-store needs at least one calibration bundle ('bundles')")
        for bundle in self.bundles:
            if not (Path(bundle) / "space.json").is_file():
                raise SettingsError(f"bundle {bundle!r} is not a calibration bundle directory (no space.json)")
        if self.store_config is not None and not Path(self.store_config).is_file():
            raise SettingsError(f"store_config {self.store_config!r} is not a file")
        if self.positions not in POSITION_MODES:
            raise SettingsError(f"positions must be one of {POSITION_MODES}, got {self.positions!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], prefix: str = "") -> EngineSettings:
        """Read ``{prefix}bundles`` etc. from ``values``; unknown ``{prefix}*`` keys are an error."""
        known = {"bundles", "store_config", "aliases", "positions"}
        ours = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
        unknown = sorted(set(ours) - known)
        if unknown:
            raise SettingsError(f"unknown scd-store settings {[prefix + k for k in unknown]}; known: "
                                f"{sorted(prefix + k for k in known)}")
        bundles = ours.get("bundles", ())
        if isinstance(bundles, str):
            bundles = [b.strip() for b in bundles.split(",") if b.strip()]
        if not isinstance(bundles, (list, tuple)) or not all(isinstance(b, str) for b in bundles):
            raise SettingsError(f"bundles must be a list of paths or a comma-separated string, got {bundles!r}")
        aliases = ours.get("aliases") or {}
        if not isinstance(aliases, Mapping):
            raise SettingsError(f"aliases must be a mapping of engine model name to bundle model name, got {aliases!r}")
        return cls(tuple(str(Path(b)) for b in bundles), ours.get("store_config"),
                   tuple(sorted((str(k), str(v)) for k, v in aliases.items())), str(ours.get("positions", "connector")))


_lock = threading.Lock()
_services: dict[tuple, tuple[KVService, int]] = {}


def acquire_service(settings: EngineSettings) -> KVService:
    """The process's service for these settings (opened on first use, reference counted)."""
    key = (settings.store_config, settings.bundles, settings.aliases)
    with _lock:
        entry = _services.get(key)
        if entry is None:
            store = open_store(load_config(settings.store_config))
            try:
                service = KVService(store, settings.bundles, aliases=dict(settings.aliases))
            except BaseException:
                store.close()
                raise
            entry = (service, 0)
        _services[key] = (entry[0], entry[1] + 1)
        return entry[0]


def release_service(service: KVService) -> None:
    """Drop one reference; the last one closes the store (draining its write queues)."""
    with _lock:
        for key, (held, refs) in list(_services.items()):
            if held is service:
                if refs <= 1:
                    del _services[key]
                    service.store.close()
                else:
                    _services[key] = (held, refs - 1)
                return
