"""scd-store as an L2 adapter of LMCache's multiprocess server: :class:`ScdL2Adapter` (``lmcache server``,
LMCache 0.5.6).

Configure on the server's command line (the ``plugin`` adapter type)::

    lmcache server --chunk-size 256 --l1-size-gb 8 --eviction-policy LRU \\
      --l2-adapter '{"type": "plugin", "module_path": "scd_store.adapters.lmcache.l2_adapter",
                     "class_name": "ScdL2Adapter",
                     "adapter_params": {"server_role": "consumer",
                                        "bundles": ["/srv/scd/bundles/shakespeare"],
                                        "store_config": "/srv/scd/store.yaml"}}'

``adapter_params`` are scd-store's engine settings (docs/engines.md) and the server's own role,
``server_role`` (required), because a server cannot tell its clients apart: whoever reaches its port
names any model in its keys, and no key says which engine sent it.

- ``consumer``: the server of consumer engines that trust each other (its clients share LMCache's own L1,
  which scd-store does not see: any of them can place KV there that the others load; reachable beyond its
  host it warns once). It reads codes and decodes them for registered consumers, stores nothing (a
  client's keys naming the producer's model are refused and counted, ``client_role_refusals``), and holds
  public keys only: a private key in its keyring is refused at start.
- ``producer``: the server of one producer engine alone. It stores that engine's chunks as codes, signed
  with the space's private key, and serves no consumer. Nothing else may reach it: it stores only while
  every socket of its process listens on the loopback address (``--host`` / ``--http-host 127.0.0.1``, on a
  host, pod or network namespace the producer engine has to itself); listening anywhere else (or where
  that cannot be told) it refuses to store, unless ``allow_remote_clients: true`` says the network is the
  producer engine's alone (a warning at start).

Store: chunks that a space's
producer engine wrote to L1 are encoded off the server's threads (the put queue) at the positions
the server reported for them (:class:`PositionLedger`, from its ``MP_TOKENS`` events; a chunk
without one is not stored and is counted), and the task completes when they are stored. Lookup
and load: a registered consumer's keys resolve to the producer's codes, decoded straight into the
L1 memory objects LMCache hands over (or, with ``decode_device: cuda``, on the GPU and copied in:
:mod:`scd_store.adapters.lmcache.device_decode`). Keys carry LMCache's ``cache_salt`` (a tenant).

Within its role, a key's model is its ``model_name``, which is the engine's, never a request's:
LMCache's multiprocess vLLM connector puts the engine's own ``model_config.model`` into every key it
sends the server, and request configs (``lmcache.tag.*``) are no part of an ``ObjectKey``, so no
request can name another model.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
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
from scd_store.adapters.lmcache.listeners import remote_listeners
from scd_store.adapters.lmcache.positions import PositionLedger
from scd_store.flags import parse_flag
from scd_store.service import EngineSettings, SettingsError, acquire_service, release_service
from scd_store.service.bindings import Binding, Role
from scd_store.service.hash_agreement import HashMismatch
from scd_store.service.log_once import LogOnce

log = logging.getLogger("scd_store.adapters.lmcache")
POSITION_WAIT_S = 1.0  # how long an L1 chunk may wait for its MP_TOKENS event
LISTEN_CHECK_S = 5.0  # how long a server trusts its last look at its listening sockets


def server_params(config: dict | None) -> tuple[Role, bool, dict]:
    """``(server_role, allow_remote_clients, the engine settings)`` of the adapter's params."""
    params = dict(config or {})
    role = params.pop("server_role", None)
    try:
        remote = parse_flag(params.pop("allow_remote_clients", False), "allow_remote_clients")
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    if role not in tuple(Role):
        raise SettingsError(f"adapter_params needs server_role: producer (the server of one producer engine alone) "
                            f"or consumer (the server of consumer engines), got {role!r}: a server cannot tell its "
                            "clients apart, so it serves one role")
    if remote and role != Role.PRODUCER:
        raise SettingsError("allow_remote_clients is a producer's server's setting")
    return Role(role), remote, params


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
            self.server_role, self.allow_remote, params = server_params(config)
            self.settings = EngineSettings.from_mapping(params)
            self.decode_target = decode_target(self.settings.decode_device)  # a device not here fails now
            self.service = acquire_service(self.settings)
            try:
                self._check_role()
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
        self._listen_checked: tuple[float, bool] | None = None  # (when, reachable only from this host)

    # ----------------------------------------------------------------- helpers
    def _check_role(self) -> None:
        """A consumer's server holds no private key; a producer's serves a producer model."""
        roles = self.service.models()
        if self.server_role == Role.CONSUMER and self.service.can_sign():
            raise SettingsError("a consumer-role lmcache server is reached by consumer engines (and whoever else "
                                "reaches its port), so it must hold public keys only: point its signing_keys at the "
                                "public key file (`scd-store keys public PRIVATE_FILE`)")
        if self.server_role == Role.PRODUCER:
            if Role.PRODUCER not in roles.values():
                raise SettingsError(f"a producer-role lmcache server needs a bundle whose producer it serves; bound: "
                                    f"{roles}")
            if self.allow_remote:
                log.warning("scd-store: allow_remote_clients: this producer's lmcache server stores whatever any "
                            "client that reaches it sends as the producer's model, signed with the space's private "
                            "key; keep its network the producer engine's alone (docs/reliability.md)")

    def _serves(self, role: Role, model: str, keys: int) -> bool:
        """Whether a client's keys of ``model`` (a ``role`` of a space) are this server's to serve: its role's
        only (counted and logged once otherwise), and a producer's only while no one else can reach it."""
        if role != self.server_role:
            what = "stores" if role == Role.PRODUCER else "lookups and loads"
            self._incidents.count("client_role_refusals", "scd-store: a client of this %s-role lmcache server sent "
                                  "%s of %r, the %s of its space: refused (a server serves one role; counted as "
                                  "client_role_refusals; logged once)", self.server_role, what, model, role, n=keys,
                                  once=f"role:{role}")
            return False
        if role == Role.PRODUCER and not self.allow_remote and not self._only_local():
            self._incidents.count("client_role_refusals", "scd-store: this producer's lmcache server can be reached "
                                  "from beyond its host (%s), so any process there could store as the producer: not "
                                  "storing (bind --host and --http-host to 127.0.0.1 where the producer engine runs "
                                  "alone, or set allow_remote_clients: true; counted as client_role_refusals; logged "
                                  "once)", self._listening, n=keys, once="remote")
            return False
        if role == Role.CONSUMER and not self._only_local():
            self._once.warn("shared-l1", "scd-store: this consumer's lmcache server can be reached from beyond its "
                            "host (%s): LMCache's own L1, which scd-store does not see, keeps KV any client stores and "
                            "serves it to the others; let only engines that trust each other reach it "
                            "(docs/reliability.md)", self._listening)
        return True

    def _only_local(self) -> bool:
        """Whether every socket this process listens on is a loopback one (looked at every ``LISTEN_CHECK_S``)."""
        now = time.monotonic()
        if self._listen_checked is None or now - self._listen_checked[0] > LISTEN_CHECK_S:
            remote = remote_listeners()
            self._listening = "who can reach it cannot be told" if remote is None else ", ".join(remote)
            self._listen_checked = (now, remote == [])
        return self._listen_checked[1]

    def _check_hashing(self) -> None:
        """Producers record the server's hashing canary, consumers compare (one server serves many
        engines: a consumer that differs is logged, counted and answers no lookups; the server runs on)."""
        canary = mp_server_canary()
        if canary is None:
            log.warning("scd-store: this lmcache server's chunk hashing cannot be checked (only blake3 is); servers "
                        "that share a store must use the same --chunk-size and --hash-algorithm")
            return
        for model, role in self.service.models().items():
            if role != self.server_role:
                continue  # a producer's server records its canary, a consumer's server compares
            try:
                self.service.check_hashing(model, canary)
            except HashMismatch as exc:
                log.error("scd-store LMCache L2 adapter: %s", exc)

    def _task_id(self) -> L2TaskId:
        with self._id_lock:
            self._next_id += 1
            return self._next_id

    def _model(self, keys: Sequence[ObjectKey], role: Role) -> tuple[str, Binding] | None:
        """The engine model name and binding of a batch of ``role``'s keys (one model, world size 1,
        the attention group); else None."""
        if not keys or len({k.model_name for k in keys}) != 1:
            return None
        if any(ObjectKey.WorldSizeFromKVRank(k.kv_rank) != 1 or k.object_group_id != 0 for k in keys):
            self._once.warn("layout", "scd-store: only world size 1 and the attention object group are coded; "
                            "other keys miss")
            return None
        model = keys[0].model_name
        binding = self.service.binding(model)
        if binding is None or binding.role != role or not self._serves(role, model, len(keys)):
            return None
        return model, binding

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
        producer = self._model(keys, Role.PRODUCER)
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
            consumer = self._model(keys, Role.CONSUMER)
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
            consumer = self._model(keys, Role.CONSUMER)
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
        return {"is_healthy": self.service is not None, "type": "ScdL2Adapter", "server_role": self.server_role.value,
                "queued_chunks": self.service.queued_chunks() if self.service is not None else 0}


__all__ = ["ScdL2Adapter", "SettingsError", "object_hash"]
