"""What an engine adapter needs from its engine's config: scd-store's settings, validated.

Every engine adapter reads the same keys (LMCache: ``extra_config`` ``scd.*``; SGLang: the
``"scd"`` object of ``--hicache-storage-backend-extra-config``):

- ``bundles``: calibration bundle directories (a list, or one string of comma-separated paths; may be
  empty: pairs registered with ``scd-store register`` are found in the registry);
- ``models``: the models this engine serves (base and adapter names): only their decoders are loaded
  from ``bundles`` (default: every pair's);
- ``discovery_interval_s``: how often models asked for without a binding are looked up in the
  registry (default 2; 0 = never);
- ``store_config``: an scd-store YAML (default: ``$SCD_STORE_CONFIG`` or the embedded CPU + disk);
- ``aliases``: ``{engine model name: bundle model name}``;
- ``put_queue_chunks``: chunks a producer may have waiting to be encoded (default 256; more are
  dropped and counted, the engine never waits);
- ``get_deadline_s``: how long a consumer's get may take before it returns what it has decoded
  (default 5);
- ``serves_adapters``: the engine also serves LoRA adapters of its model (default false; SGLang
  says so itself). A request the adapter cannot be told from is then neither stored nor served, and
  the engine never writes (no request of it can be attributed to the base model by the engine);
- ``register_bundles``: register ``bundles`` in the registry at start (default true); false for
  engines that may only read the registry (records are then written by ``scd-store register``, and
  only what the registry holds as the bundles have it is bound);
- ``max_positions``: the engine's context length (default 32768); stored chunks reaching past it are
  refused before anything is allocated for them;
- ``model_tag`` (LMCache): on an engine with ``serves_adapters``, the request tag
  ``lmcache.tag.<model_tag>`` naming the adapter (a registered consumer of the engine's space) a
  request reads as (default ``scd_model``; set it at a gateway); ignored elsewhere: roles come from
  the engine, never from a request.

A stored chunk's absolute position always comes from the engine (LMCache:
``MemoryObj.metadata.cached_positions``; SGLang: ``prefix_keys``); a chunk without one is not
stored and is counted (``unpositioned_chunks``). Engines in one process that name the same
settings share one store and service (:mod:`scd_store.service.shared`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scd_store.errors import ScdStoreError

KNOWN = ("bundles", "store_config", "aliases", "put_queue_chunks", "get_deadline_s", "serves_adapters", "model_tag",
         "models", "discovery_interval_s", "register_bundles", "max_positions")


class SettingsError(ScdStoreError, ValueError):
    """A bad scd-store section in an engine's configuration."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """scd-store's keys in an engine config, validated."""

    bundles: tuple[str, ...]
    store_config: str | None = None
    aliases: tuple[tuple[str, str], ...] = field(default=())
    put_queue_chunks: int = 256
    get_deadline_s: float = 5.0
    serves_adapters: bool = False
    model_tag: str = "scd_model"
    models: tuple[str, ...] | None = None
    discovery_interval_s: float = 2.0
    register_bundles: bool = True
    max_positions: int = 32768

    def __post_init__(self) -> None:
        for bundle in self.bundles:
            if not (Path(bundle) / "space.json").is_file():
                raise SettingsError(f"bundle {bundle!r} is not a calibration bundle directory (no space.json)")
        if self.store_config is not None and not Path(self.store_config).is_file():
            raise SettingsError(f"store_config {self.store_config!r} is not a file")
        if isinstance(self.put_queue_chunks, bool) or not isinstance(self.put_queue_chunks, int) \
                or self.put_queue_chunks <= 0:
            raise SettingsError(f"put_queue_chunks must be a positive int, got {self.put_queue_chunks!r}")
        if not self.get_deadline_s > 0:
            raise SettingsError(f"get_deadline_s must be positive, got {self.get_deadline_s!r}")
        if not isinstance(self.serves_adapters, bool):
            raise SettingsError(f"serves_adapters must be true or false, got {self.serves_adapters!r}")
        if not isinstance(self.model_tag, str) or not self.model_tag:
            raise SettingsError(f"model_tag must be a non-empty string, got {self.model_tag!r}")
        if self.models is not None and not all(isinstance(m, str) and m for m in self.models):
            raise SettingsError(f"models must be a list of model names, got {self.models!r}")
        if not isinstance(self.register_bundles, bool):
            raise SettingsError(f"register_bundles must be true or false, got {self.register_bundles!r}")
        if isinstance(self.max_positions, bool) or not isinstance(self.max_positions, int) or self.max_positions <= 0:
            raise SettingsError(f"max_positions must be a positive int, got {self.max_positions!r}")
        if not self.discovery_interval_s >= 0:
            raise SettingsError(f"discovery_interval_s must be >= 0, got {self.discovery_interval_s!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], prefix: str = "") -> EngineSettings:
        """Read ``{prefix}bundles`` etc. from ``values``; unknown ``{prefix}*`` keys are an error."""
        ours = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
        unknown = sorted(set(ours) - set(KNOWN))
        if unknown:
            hint = " (positions always come from the engine now)" if "positions" in unknown else ""
            raise SettingsError(f"unknown scd-store settings {[prefix + k for k in unknown]}{hint}; known: "
                                f"{sorted(prefix + k for k in KNOWN)}")
        bundles = ours.get("bundles", ())
        if isinstance(bundles, str):
            bundles = [b.strip() for b in bundles.split(",") if b.strip()]
        if not isinstance(bundles, (list, tuple)) or not all(isinstance(b, str) for b in bundles):
            raise SettingsError(f"bundles must be a list of paths or a comma-separated string, got {bundles!r}")
        aliases = ours.get("aliases") or {}
        if not isinstance(aliases, Mapping):
            raise SettingsError(f"aliases must be a mapping of engine model name to bundle model name, got {aliases!r}")
        try:
            queue_chunks = int(ours.get("put_queue_chunks", 256))
            deadline = float(ours.get("get_deadline_s", 5.0))
            interval = float(ours.get("discovery_interval_s", 2.0))
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"put_queue_chunks, get_deadline_s and discovery_interval_s must be numbers: "
                                f"{exc}") from exc
        models = ours.get("models")
        if isinstance(models, str):
            models = [m.strip() for m in models.split(",") if m.strip()]
        if models is not None and not isinstance(models, (list, tuple)):
            raise SettingsError(f"models must be a list of model names, got {models!r}")
        serves, register = (_flag(ours.get(name, default)) for name, default in
                            (("serves_adapters", False), ("register_bundles", True)))
        try:
            max_positions = int(ours.get("max_positions", 32768))
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"max_positions must be an int: {exc}") from exc
        return cls(tuple(str(Path(b)) for b in bundles), ours.get("store_config"),
                   tuple(sorted((str(k), str(v)) for k, v in aliases.items())), queue_chunks, deadline, serves,
                   ours.get("model_tag", "scd_model"), None if models is None else tuple(models), interval, register,
                   max_positions)


def _flag(value: Any) -> Any:
    """``"true"`` / ``"false"`` strings (engine configs pass strings) as bools; anything else unchanged."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value
