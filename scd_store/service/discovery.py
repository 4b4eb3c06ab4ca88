"""Pairs and spaces registered after an engine started (``scd-store register``), bound without a restart:
:class:`PairDiscovery`.

A lookup for a model the service has no binding for only records the name (no I/O on the engine's
thread; that request is a miss). A background thread reads the registry every ``interval_s`` and, for
each such model that the registry names as a pair's consumer or a space's producer, loads that one
decoder (or the space) from the recorded bundle directory, checks it against the registry's
fingerprints and binds it. So a process loads only the decoders of models it is asked for, and a new
pair serves within about ``interval_s`` of its first request.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from scd_store.codecs.scd.bundle import BundleError, load_pair, load_space
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.space import CodeSpace
from scd_store.service.bindings import Binding, Bindings, Role, ServiceError
from scd_store.service.defaults import DISCOVERY_INTERVAL_S
from scd_store.service.log_once import Incidents, LogOnce
from scd_store.store.records import RegistryError
from scd_store.store.registry import Registry
from scd_store.store.stats import StoreStats

log = logging.getLogger("scd_store.service")


class PairDiscovery:
    """Binds wanted models from the registry on a background thread (:meth:`poll_once` is one round)."""

    def __init__(self, registry: Registry, bindings: Bindings, stats: StoreStats,
                 interval_s: float = DISCOVERY_INTERVAL_S) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0 (0: never poll), got {interval_s}")
        self.registry, self.bindings, self.stats, self.interval_s = registry, bindings, stats, interval_s
        self._wanted: set[str] = set()
        self._lock = threading.Lock()
        self._once = LogOnce(log)
        self._incidents = Incidents(stats, log)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def want(self, model: str) -> None:
        """Note that ``model`` (a bundle model name, after aliases) was asked for and has no binding."""
        if model in self._wanted:
            return
        with self._lock:
            self._wanted.add(model)
            self._start()

    def _start(self) -> None:
        if self._thread is None and self.interval_s > 0 and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="scd-store-discovery", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
            except Exception as exc:  # noqa: BLE001 - a registry outage must not end discovery
                self._once.warn(f"poll:{type(exc).__name__}", "scd-store: registry poll failed (%s); retrying", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def poll_once(self) -> list[str]:
        """Bind every wanted model the registry now knows; returns the names bound."""
        with self._lock:
            wanted = sorted(m for m in self._wanted if self.bindings.get(m) is None)
        if not wanted:
            return []
        pairs, spaces, locations = self.registry.pairs(), self.registry.spaces(), self.registry.locations()
        bound = []
        for model in wanted:
            mine = self._prefer_held([p for p in pairs if p.consumer_model_id == model], "space_fingerprint")
            produced = self._prefer_held([s for s in spaces if s.producer_model_id == model], "bundle_fingerprint")
            if len(mine) + len(produced) != 1:
                if mine or produced:
                    self._once.warn(f"ambiguous:{model}", "scd-store: %r is registered %d times (pairs %s, spaces "
                                    "%s); bind it with an engine setting instead", model, len(mine) + len(produced),
                                    [p.pair_id for p in mine], [s.space_id for s in produced])
                continue
            try:
                binding = self._consumer(mine[0], spaces, locations) if mine else self._producer(produced[0], locations)
                self.bindings.add(binding)
            except (BundleError, RegistryError, ServiceError, OSError, ValueError) as exc:
                self._incidents.count("discovery_errors", "scd-store: cannot bind %r from the registry: %s", model, exc,
                                      once=f"load:{model}")
                with self._lock:
                    self._wanted.discard(model)  # asked again, tried again
                continue
            self.stats.inc("discovered_models")
            log.info("scd-store: bound %r as %s of space %r (registered after start)", model, binding.role,
                     binding.space.space_id)
            bound.append(model)
        return bound

    def _prefer_held(self, records: list, field: str) -> list:
        """Of several generations naming a model, the ones whose space this process already holds (a
        rollout: the process stays on its generation); all of them when it holds none."""
        if len(records) < 2:
            return records
        held = [r for r in records if self.bindings.space(getattr(r, field)) is not None]
        return held or records

    def _space(self, path: str, space_id: str, fingerprint: str) -> CodeSpace:
        """The registered space: the one a binding of this process already holds (from ``bundles`` or an
        earlier discovery), else loaded from ``path`` and checked against the registry."""
        held = self.bindings.space(fingerprint)
        if held is not None and held.space_id == space_id:
            return held
        space = load_space(Path(path))
        if space.space_id != space_id or space.fingerprint != fingerprint:
            raise BundleError(f"the bundle at {path} holds space {space.space_id} {space.fingerprint}, the "
                              f"registry registered {space_id} {fingerprint}")
        return space

    def _consumer(self, pair, spaces, locations: dict[str, str]) -> Binding:
        path = locations.get(pair.ident)
        record = next((s for s in spaces if s.space_id == pair.space_id and s.fingerprint == pair.space_fingerprint),
                      None)
        if path is None or record is None:
            raise RegistryError(f"pair {pair.pair_id} has no recorded bundle or space (register it with "
                                "`scd-store register BUNDLE`)")
        space = self._space(path, record.space_id, record.bundle_fingerprint)
        decoder = load_pair(Path(path), pair.consumer_model_id, space)
        if decoder.fingerprint != pair.bundle_fingerprint:
            raise BundleError(f"the decoder at {path} is not the one registered for {pair.pair_id}")
        return Binding(pair.consumer_model_id, Role.CONSUMER, space, ScdCodec(space, decoder), pair.pair_id)

    def _producer(self, record, locations: dict[str, str]) -> Binding:
        path = locations.get(record.ident)
        if path is None:
            raise RegistryError(f"space {record.space_id} has no recorded bundle")
        space = self._space(path, record.space_id, record.bundle_fingerprint)
        return Binding(record.producer_model_id, Role.PRODUCER, space, ScdCodec(space))
