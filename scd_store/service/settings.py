"""The engine's branch of the configuration tree: :class:`EngineSettings`, scd-store's keys in an engine's config.

Every engine adapter reads the same keys (LMCache: ``extra_config`` ``scd.*``; SGLang: the
``"scd"`` object of ``--hicache-storage-backend-extra-config``), each defined once as a field
below, its default taken from :mod:`scd_store.service.defaults`:

- ``bundles``: calibration bundle directories (a list, or one string of comma-separated paths; may be
  empty: pairs registered with ``scd-store register`` are found in the registry);
- ``store_config``: an scd-store YAML, the store's branch of the tree
  (:class:`~scd_store.store.config.StoreConfig`; default: ``$SCD_STORE_CONFIG`` or the embedded CPU + disk);
- ``aliases``: ``{engine model name: bundle model name}``;
- ``put_queue_chunks`` / ``put_queue_bytes``: chunks, and bytes of the engine's KV they hold (pinned
  host memory on a GPU engine), a producer may have waiting to be encoded (more are dropped and
  counted, the engine never waits);
- ``get_deadline_s``: how long a consumer's get may take before it returns what it has decoded;
- ``serves_adapters``: the engine also serves LoRA adapters of its model (default false; SGLang
  says so itself). A request the adapter cannot be told from is then neither stored nor served, and
  the engine never writes (no request of it can be attributed to the base model by the engine);
- ``model_tag`` (LMCache): on an engine with ``serves_adapters``, the request tag
  ``lmcache.tag.<model_tag>`` naming the adapter (a registered consumer of the engine's space) a
  request reads as (set it at a gateway); ignored elsewhere: roles come from the engine, never from
  a request;
- ``models``: the models this engine serves (base and adapter names): only their decoders are loaded
  from ``bundles`` (default: every pair's);
- ``discovery_interval_s``: how often models asked for without a binding are looked up in the
  registry (0 = never);
- ``register_bundles``: register ``bundles`` in the registry at start (default true); false for
  engines that may only read the registry (records are then written by ``scd-store register``, and
  only what the registry holds as the bundles have it is bound);
- ``max_positions``: the engine's context length; stored chunks reaching past it are refused before
  anything is allocated for them;
- ``async_loads`` (vLLM): load a consumer hit that only a remote tier holds between steps, off the
  engine's step (default true; false loads every hit before the step's forward);
- ``load_workers`` (vLLM, with ``async_loads``): fetch threads for asynchronous loads (0, the default:
  derived from vLLM's ``max_num_seqs``, :func:`scd_store.adapters.vllm.async_loads.load_workers`);
- ``load_deadline_s`` (vLLM, with ``async_loads``): how long an asynchronous load may take from when it is
  handed over, queued and running; past it the blocks it has not filled are recomputed by the engine;
- ``decode_device`` (LMCache, SGLang): where a consumer's codes are decoded into KV before the engine's
  own copy takes them (``cpu``, the default, or ``cuda`` / ``cuda:N``); the vLLM connector always decodes
  on its cache's device.

Booleans follow :func:`scd_store.flags.parse_flag`. The fields marked as :class:`KVService` keywords
reach it through :meth:`EngineSettings.service_kwargs`; ``serves_adapters``, ``model_tag``,
``decode_device``, ``async_loads``, ``lookup_deadline_s``, ``load_workers`` and ``load_deadline_s`` stay with
the adapter. A stored chunk's absolute position
always comes from the engine (LMCache:
``MemoryObj.metadata.cached_positions``; SGLang: ``prefix_keys``); a chunk without one is not
stored and is counted (``unpositioned_chunks``). Engines in one process whose settings have the same
:meth:`EngineSettings.shared_key` share one store and service (:mod:`scd_store.service.shared`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from scd_store.errors import ScdStoreError
from scd_store.flags import parse_flag
from scd_store.service import defaults
from scd_store.store.config import parse_bytes


class SettingsError(ScdStoreError, ValueError):
    """A bad scd-store section in an engine's configuration."""


def _split(value: Any) -> Any:
    """``"a, b"`` -> ``["a", "b"]``; anything else unchanged."""
    return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value


def _paths(value: Any, name: str) -> tuple[str, ...]:
    value = _split(value)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise SettingsError(f"{name} must be a list of paths or a comma-separated string, got {value!r}")
    return tuple(str(Path(v)) for v in value)


def _names(value: Any, name: str) -> tuple[str, ...] | None:
    value = _split(value)
    if value is not None and not isinstance(value, (list, tuple)):
        raise SettingsError(f"{name} must be a list of model names, got {value!r}")
    return None if value is None else tuple(value)


def _aliases(value: Any, name: str) -> tuple[tuple[str, str], ...]:
    value = value or {}
    if not isinstance(value, Mapping):
        raise SettingsError(f"{name} must be a mapping of engine model name to bundle model name, got {value!r}")
    return tuple(sorted((str(k), str(v)) for k, v in value.items()))


def _int(value: Any, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{name} must be an int, got {value!r}") from exc


def _size(value: Any, name: str) -> int:
    """An int, or a size in text (``512MiB``, ``2GB``; :func:`scd_store.store.config.parse_bytes`)."""
    try:
        return parse_bytes(value)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{name} must be a size in bytes (e.g. 2GiB), got {value!r}") from exc


def _number(value: Any, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{name} must be a number, got {value!r}") from exc


def _bool(value: Any, name: str) -> bool:
    try:
        return parse_flag(value, name)
    except ValueError as exc:
        raise SettingsError(str(exc)) from exc


def _as_given(value: Any, name: str) -> Any:
    return value


_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _device(value: Any, name: str) -> str:
    text = str(value).strip().lower() if isinstance(value, str) else value
    if not isinstance(text, str) or not _DEVICE.match(text):
        raise SettingsError(f"{name} must be cpu, cuda or cuda:N, got {value!r}")
    return text


def _key(read: Callable[[Any, str], Any], *, default: Any, role: str = "") -> Any:
    """A field: its default, how :meth:`EngineSettings.from_mapping` reads its value, and its ``role``
    (``"service"``: a :class:`KVService` keyword; ``"adapter"``: the engine adapter's alone)."""
    return field(default=default, metadata={"read": read, "role": role})


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """scd-store's keys in an engine config, validated; frozen and hashable."""

    bundles: tuple[str, ...] = _key(_paths, default=())
    store_config: str | None = _key(_as_given, default=None)
    aliases: tuple[tuple[str, str], ...] = _key(_aliases, default=(), role="service")
    put_queue_chunks: int = _key(_int, default=defaults.PUT_QUEUE_CHUNKS, role="service")
    put_queue_bytes: int = _key(_size, default=defaults.PUT_QUEUE_BYTES, role="service")
    get_deadline_s: float = _key(_number, default=defaults.GET_DEADLINE_S, role="service")
    serves_adapters: bool = _key(_bool, default=False, role="adapter")
    model_tag: str = _key(_as_given, default=defaults.MODEL_TAG, role="adapter")
    models: tuple[str, ...] | None = _key(_names, default=None, role="service")
    discovery_interval_s: float = _key(_number, default=defaults.DISCOVERY_INTERVAL_S, role="service")
    register_bundles: bool = _key(_bool, default=True, role="service")
    max_positions: int = _key(_int, default=defaults.MAX_POSITIONS, role="service")
    decode_device: str = _key(_device, default=defaults.DECODE_DEVICE, role="adapter")
    async_loads: bool = _key(_bool, default=True, role="adapter")
    lookup_deadline_s: float = _key(_number, default=defaults.LOOKUP_DEADLINE_S, role="adapter")
    load_workers: int = _key(_int, default=defaults.LOAD_WORKERS, role="adapter")
    load_deadline_s: float = _key(_number, default=defaults.LOAD_DEADLINE_S, role="adapter")

    def __post_init__(self) -> None:
        for bundle in self.bundles:
            if not (Path(bundle) / "space.json").is_file():
                raise SettingsError(f"bundle {bundle!r} is not a calibration bundle directory (no space.json)")
        if self.store_config is not None and not Path(self.store_config).is_file():
            raise SettingsError(f"store_config {self.store_config!r} is not a file")
        if isinstance(self.put_queue_chunks, bool) or not isinstance(self.put_queue_chunks, int) \
                or self.put_queue_chunks <= 0:
            raise SettingsError(f"put_queue_chunks must be a positive int, got {self.put_queue_chunks!r}")
        if isinstance(self.put_queue_bytes, bool) or not isinstance(self.put_queue_bytes, int) \
                or self.put_queue_bytes <= 0:
            raise SettingsError(f"put_queue_bytes must be a positive size, got {self.put_queue_bytes!r}")
        for name in ("get_deadline_s", "lookup_deadline_s", "load_deadline_s"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("serves_adapters", "register_bundles", "async_loads"):
            if not isinstance(getattr(self, name), bool):
                raise SettingsError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.model_tag, str) or not self.model_tag:
            raise SettingsError(f"model_tag must be a non-empty string, got {self.model_tag!r}")
        if self.models is not None and not all(isinstance(m, str) and m for m in self.models):
            raise SettingsError(f"models must be a list of model names, got {self.models!r}")
        if isinstance(self.load_workers, bool) or not isinstance(self.load_workers, int) or self.load_workers < 0:
            raise SettingsError(f"load_workers must be an int >= 0 (0: derived), got {self.load_workers!r}")
        if isinstance(self.max_positions, bool) or not isinstance(self.max_positions, int) or self.max_positions <= 0:
            raise SettingsError(f"max_positions must be a positive int, got {self.max_positions!r}")
        _device(self.decode_device, "decode_device")
        if not self.discovery_interval_s >= 0:
            raise SettingsError(f"discovery_interval_s must be >= 0, got {self.discovery_interval_s!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], prefix: str = "") -> EngineSettings:
        """Read ``{prefix}bundles`` etc. from ``values``, each by its field's reader (absent ones take the
        field's default); unknown ``{prefix}*`` keys are an error."""
        ours = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
        unknown = sorted(set(ours) - set(KNOWN))
        if unknown:
            hint = " (positions come from the engine, never from a setting)" if "positions" in unknown else ""
            raise SettingsError(f"unknown scd-store settings {[prefix + k for k in unknown]}{hint}; known: "
                                f"{sorted(prefix + k for k in KNOWN)}")
        return cls(**{f.name: f.metadata["read"](ours[f.name], f.name) for f in fields(cls) if f.name in ours})

    def service_kwargs(self) -> dict[str, Any]:
        """The :class:`~scd_store.service.kv_service.KVService` keywords: every ``"service"`` field (aliases
        as a dict)."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["role"] == "service"}
        kwargs["aliases"] = dict(self.aliases)
        return kwargs

    def shared_key(self) -> EngineSettings:
        """These settings with the adapter's own keys at their defaults: engines whose keys are equal need the
        same store and service, so they share one."""
        return replace(self, **{f.name: f.default for f in fields(self) if f.metadata["role"] == "adapter"})


KNOWN = tuple(f.name for f in fields(EngineSettings))
