"""scd-store as an L2 adapter of LMCache's multiprocess server: :class:`ScdL2Adapter` (``lmcache server``,
LMCache 0.5.6).

Configure on the server's command line (the ``plugin`` adapter type)::

    lmcache server --chunk-size 256 --l1-size-gb 8 --eviction-policy LRU \\
      --l2-adapter '{"type": "plugin", "module_path": "scd_store.adapters.lmcache.l2_adapter",
                     "class_name": "ScdL2Adapter",
                     "adapter_params": {"bundles": ["/srv/scd/bundles/shakespeare"],
                                        "store_config": "/srv/scd/store.yaml"}}'

``adapter_params`` are scd-store's engine settings (docs/engines.md). Store: chunks that a space's
producer engine wrote to L1 are encoded off the server's threads (the put queue) at the positions
the server reported for them (:class:`PositionLedger`, from its ``MP_TOKENS`` events; a chunk
without one is not stored and is counted), and the task completes when they are stored. Lookup
and load: a registered consumer's keys resolve to the producer's codes, decoded straight into the
L1 memory objects LMCache hands over (or, with ``decode_device: cuda``, on the GPU and copied in:
:mod:`scd_store.adapters.lmcache.device_decode`). Keys carry LMCache's ``cache_salt`` (a tenant).

Roles come from the key's ``model_name``, which is the engine's, never a request's: LMCache's
multiprocess vLLM connector puts the engine's own ``model_config.model`` into every key it sends
the server, and request configs (``lmcache.tag.*``) are no part of an ``ObjectKey``, so no
request can name another model. Whoever can reach the server's socket speaks for an engine: keep
it on a host or network only the deployment's engines reach.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.mp_observability.event import EventType
from lmcache.v1.platform import create_event_notifier

from scd_store.adapters.lmcache.device_decode import decode_target
from scd_store.adapters.lmcache.hashing import mp_server_canary
from scd_store.adapters.lmcache.layout import state_from_kv_2ltd
from scd_store.adapters.lmcache.positions import PositionLedger
from scd_store.service import EngineSettings, SettingsError, acquire_service, release_service
from scd_store.service.bindings import Binding
from scd_store.service.hash_agreement import HashMismatch
from scd_store.service.log_once import LogOnce

log = logging.getLogger("scd_store.adapters.lmcache")
POSITION_WAIT_S = 1.0  # how long an L1 chunk may wait for its MP_TOKENS event


def object_hash(key: ObjectKey) -> bytes:
    """A 16-byte store hash for an LMCache object key: its chunk hash, in its ``cache_salt`` namespace."""
    return hashlib.sha256(b"lmcache-mp/" + bytes(key.chunk_hash) + b"|salt|" + key.cache_salt.encode()).digest()[:16]


class _Results:
    """Completed task results of one kind, popped once, with the event fd that announces them."""

    def __init__(self) -> None:
        self.notifier = create_event_notifier()
        self._lock = threading.Lock()
        self._done: dict[L2TaskId, Any] = {}

    def finish(self, task_id: L2TaskId, result: Any) -> None:
        with self._lock:
            self._done[task_id] = result
        self.notifier.notify()

    def pop(self, task_id: L2TaskId) -> Any:
        with self._lock:
            return self._done.pop(task_id, None)

    def pop_all(self) -> dict[L2TaskId, Any]:
        with self._lock:
            done, self._done = self._done, {}
        return done


class ScdL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter over scd-store's :class:`~scd_store.service.KVService`."""

    def __init__(self, config: dict, l1_memory_desc: Any = None) -> None:
        super().__init__(0)
        try:
            self.settings = EngineSettings.from_mapping(config or {})
            self.decode_target = decode_target(self.settings.decode_device)  # a device not here fails now
            self.service = acquire_service(self.settings)
            try:
                self._check_hashing()
            except BaseException:
                release_service(self.service)
                raise
        except Exception as exc:
            log.error("scd-store LMCache L2 adapter: bad configuration: %s", exc)
            raise
        self.positions = PositionLedger()
        self._event_bus.subscribe(EventType.MP_TOKENS, self.positions.record_event)
        self._stores, self._lookups, self._loads = _Results(), _Results(), _Results()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="scd-store-l2")
        self._next_id = 0
        self._id_lock = threading.Lock()
        self._once = LogOnce(log)
        self._incidents = self.service.incidents(log)

    # ----------------------------------------------------------------- helpers
    def _check_hashing(self) -> None:
        """Producers record the server's hashing canary, consumers compare (one server serves many
        engines: a consumer that differs is logged, counted and answers no lookups; the server runs on)."""
        canary = mp_server_canary()
        if canary is None:
            log.warning("scd-store: this lmcache server's chunk hashing cannot be checked (only blake3 is); servers "
                        "that share a store must use the same --chunk-size and --hash-algorithm")
            return
        for model in self.service.models():
            try:
                self.service.check_hashing(model, canary)
            except HashMismatch as exc:
                log.error("scd-store LMCache L2 adapter: %s", exc)

    def _task_id(self) -> L2TaskId:
        with self._id_lock:
            self._next_id += 1
            return self._next_id

    def _model(self, keys: Sequence[ObjectKey], role: str) -> tuple[str, Binding] | None:
        """The engine model name and binding of a batch of ``role``'s keys (one model, world size 1,
        the attention group); else None."""
        if not keys or len({k.model_name for k in keys}) != 1:
            return None
        if any(ObjectKey.WorldSizeFromKVRank(k.kv_rank) != 1 or k.object_group_id != 0 for k in keys):
            self._once.warn("layout", "scd-store: only world size 1 and the attention object group are coded; "
                            "other keys miss")
            return None
        binding = self.service.binding(keys[0].model_name)
        return (keys[0].model_name, binding) if binding is not None and binding.role == role else None

    # ----------------------------------------------------------------- event fds
    def get_store_event_fd(self) -> int:
        return self._stores.notifier.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookups.notifier.fileno()

    def get_load_event_fd(self) -> int:
        return self._loads.notifier.fileno()

    # ----------------------------------------------------------------- store
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        """Producer chunks go to the put worker; the task completes once they are stored (LMCache holds
        the objects' read locks until then). Anything else completes at once, storing nothing."""
        task_id = self._task_id()
        producer = self._model(keys, "producer")
        if producer is None:
            self._stores.finish(task_id, L2StoreResult(success=True, bytes_transferred=0))
            return task_id
        model, binding = producer
        heads = binding.space.layout.kv_heads

        def states() -> list | None:
            starts = self.positions.positions([k.chunk_hash for k in keys], timeout=POSITION_WAIT_S)
            if None in starts:
                self._incidents.count("unpositioned_chunks", "scd-store: the server reported no positions for "
                                      "chunks of %r (MP_TOKENS events come with its server-driven transfer path); "
                                      "not storing them (counted as unpositioned_chunks; logged once)", model,
                                      n=len(keys), once="positions")
                return None
            return [state_from_kv_2ltd(obj.tensor, heads, start) for obj, start in zip(objects, starts, strict=True)]

        nbytes = sum(obj.get_size() for obj in objects)
        def done(stored: int) -> None:
            self._stores.finish(task_id, L2StoreResult(success=True, bytes_transferred=nbytes if stored else 0))

        self.service.submit_put(model, [object_hash(k) for k in keys], states, done=done)
        return task_id

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return self._stores.pop_all()

    # ----------------------------------------------------------------- lookup and load
    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs: dict) -> L2TaskId:
        task_id = self._task_id()
        desc = (group_layout_descs or {}).get(0)
        shape = desc.shapes[0] if desc is not None and desc.shapes else ()
        chunk_tokens = int(shape[2]) if len(shape) == 4 else None  # KV_2LTD [2, layers, tokens, width]
        self._executor.submit(self._lookup, task_id, keys, chunk_tokens)
        return task_id

    def _lookup(self, task_id: L2TaskId, keys: list[ObjectKey], chunk_tokens: int | None) -> None:
        bitmap = Bitmap(len(keys))
        try:
            consumer = self._model(keys, "consumer")
            if consumer is not None:
                tokens = len(keys) * chunk_tokens if chunk_tokens else None
                found = self.service.contains(consumer[0], [object_hash(k) for k in keys], tokens=tokens)
                if found:
                    bitmap.set_range(0, found)
        except Exception as exc:  # a lookup that fails is a miss
            log.warning("scd-store: L2 lookup failed: %s", exc)
        self._lookups.finish(task_id, bitmap)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._lookups.pop(task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        return None  # codes are immutable and shared; nothing is locked per engine

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = self._task_id()
        self._executor.submit(self._load, task_id, keys, objects)
        return task_id

    def _load(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            consumer = self._model(keys, "consumer")
            if consumer is not None:
                model, binding = consumer
                with self.decode_target.batch(binding.space.layout.kv_heads) as batch:  # copies land by its end

                    def into(i: int, tokens: int) -> Any:
                        tensor = objects[i].tensor
                        return batch.buffers(tensor) if tensor is not None and tensor.shape[2] == tokens else None

                    states = self.service.get(model, [object_hash(k) for k in keys], into=into)
                    batch.land(len(states))
                if states:
                    bitmap.set_range(0, len(states))
        except Exception as exc:  # a load that fails is a miss
            log.warning("scd-store: L2 load failed: %s", exc)
        self._loads.finish(task_id, bitmap)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._loads.pop(task_id)

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        self._executor.shutdown(wait=True)
        service, self.service = getattr(self, "service", None), None
        if service is not None:
            release_service(service)
        for results in (self._stores, self._lookups, self._loads):
            results.notifier.close()

    def report_status(self) -> dict:
        return {"is_healthy": self.service is not None, "type": "ScdL2Adapter",
                "queued_chunks": self.service.queued_chunks() if self.service is not None else 0}


__all__ = ["ScdL2Adapter", "SettingsError", "object_hash"]
