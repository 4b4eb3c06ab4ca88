"""What an engine adapter needs from its engine's config: scd-store's settings, validated.

Both the LMCache plugin and the SGLang backend read the same keys (LMCache: ``extra_config``
``scd.*``; SGLang: the ``--hicache-storage-backend-extra-config`` JSON without the prefix):

- ``bundles``: calibration bundle directories (a list, or one string of comma-separated paths);
- ``store_config``: an scd-store YAML (default: ``$SCD_STORE_CONFIG`` or the embedded CPU + disk);
- ``aliases``: ``{engine model name: bundle model name}``;
- ``positions``: where a stored chunk's absolute position comes from. ``connector`` (default):
  from the engine (LMCache: ``MemoryObj.metadata.cached_positions``; SGLang: ``prefix_keys``);
  chunks without one are not stored. ``batch``: when the engine gives none, a put batch is taken
  to start at position 0 (right only for engines that store whole prompts).

Engines in one process that name the same store config and bundles share one store and service
(:mod:`scd_store.service.shared`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
