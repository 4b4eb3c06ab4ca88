"""scd-store as an LMCache storage plugin: :class:`ScdStoragePlugin` (``StoragePluginInterface``, LMCache 0.5.6).

Configure in the LMCache YAML::

    pre_caching_hash_algorithm: sha256_cbor    # LMCache's default (Python's hash) is refused
    storage_plugins: [scd]
    extra_config:
      storage_plugin.scd.module_path: scd_store.adapters.lmcache.plugin
      storage_plugin.scd.class_name: ScdStoragePlugin
      scd.bundles: /path/to/bundle            # comma-separated for several spaces
      scd.store_config: /path/to/scd-store.yaml   # optional

Store path: chunks that a space's producer engine stores are handed to scd-store's put worker
(the engine's thread returns at once; a reference on each memory object is held until then),
encoded into its code space at the positions the GPU connector recorded
(``MemoryObj.metadata.cached_positions``; a chunk without them is not stored and is counted) and
put under LMCache's chunk hash. Retrieve path: a registered consumer engine asking for the same chunk
hash (under its own model name) gets the producer's codes decoded into its own KV, straight into a
``KV_2LTD`` memory object from LMCache's CPU allocator (no copy; with ``scd.decode_device: cuda`` on the
GPU, then copied in: :mod:`scd_store.adapters.lmcache.device_decode`): an ordinary LMCache hit. Everyone else
misses. Who a chunk belongs to comes from the engine (:mod:`scd_store.adapters.lmcache.identity`): a
request's model tag never makes it a producer's, and salted requests (tagged by
:class:`~scd_store.adapters.vllm.lmcache_cpu.LMCacheCpuConnector` and ``lmcache_gpu.LMCacheGpuConnector``) are
neither stored nor served.
LMCache's async lookup and load hooks (``batched_async_contains``,
``batched_get_non_blocking``) run the same calls off its event loop. A bad configuration raises at
construction (LMCache only logs that, so the error is also logged here with the fix).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from scd_store.adapters.lmcache.device_decode import decode_target
from scd_store.adapters.lmcache.hashing import lmcache_canary
from scd_store.adapters.lmcache.identity import SALT_TAG, ChunkIdentity, batch_identity, key_identity
from scd_store.adapters.lmcache.layout import chunk_hash_bytes, state_from_kv_2ltd
from scd_store.codecs.kv_state import KVState
from scd_store.service import EngineSettings, Role, SettingsError, acquire_service, release_service
from scd_store.service.engine_facts import serves_lora
from scd_store.service.log_once import LogOnce

log = logging.getLogger("scd_store.adapters.lmcache")


def engine_serves_lora() -> bool:
    """Whether this process's engine serves LoRA adapters: said by scd-store's vLLM connector in this process
    (:mod:`scd_store.service.engine_facts`), or by the vLLM config in force while LMCache builds its backends."""
    if serves_lora():
        return True
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return False
    config = get_current_vllm_config_or_none()
    return config is not None and getattr(config, "lora_config", None) is not None


SETTINGS_PREFIX = "scd."


class ScdStoragePlugin(StoragePluginInterface):
    """LMCache backend over scd-store's :class:`~scd_store.service.KVService`."""

    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None, loop: Any = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        try:
            self._check_engine(config, metadata, local_cpu_backend)
            settings = EngineSettings.from_mapping(config.extra_config or {}, prefix=SETTINGS_PREFIX)
            self.decode_target = decode_target(settings.decode_device)  # a device not here fails now
            self.model_tag = settings.model_tag
            # LMCache keys carry no LoRA id: an engine that serves adapters is one whichever the setting says
            self.serves_adapters = settings.serves_adapters or engine_serves_lora()
            self.service = acquire_service(settings)
            try:
                self.model = metadata.model_name
                self._check_layout(metadata)
                self.service.check_hashing(self.model, lmcache_canary(config))
            except BaseException:
                release_service(self.service)
                raise
        except Exception as exc:
            log.error("scd-store LMCache plugin: bad configuration: %s", exc)
            raise
        self._once = LogOnce(log)
        self._incidents = self.service.incidents(log)
        if self.serves_adapters:
            log.info("scd-store LMCache plugin: this engine serves adapters (serves_adapters): it reads for the "
                     "consumers of %r's space its requests name with lmcache.tag.%s and never writes (produce from "
                     "an engine without adapters)", self.model, self.model_tag)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="scd-store-lmcache")

    # ----------------------------------------------------------------- construction checks
    @staticmethod
    def _check_engine(config: Any, metadata: Any, local_cpu_backend: Any) -> None:
        if config is None or metadata is None:
            raise SettingsError("the plugin needs LMCache's config and metadata")
        if local_cpu_backend is None:
            raise SettingsError("the plugin allocates retrieved chunks from LMCache's CPU backend: set local_cpu: true")
        if metadata.world_size != 1:
            raise SettingsError(f"tensor parallel engines (world_size={metadata.world_size}) are not supported: "
                                "codes are calibrated over all KV heads of a layer")
        if getattr(metadata, "use_mla", False):
            raise SettingsError("MLA models are not supported")

    def _check_layout(self, metadata: Any) -> None:
        binding = self.service.binding(self.model)
        if binding is None:
            log.warning("scd-store LMCache plugin: model %r is in no bundle (bound: %s); its requests miss until "
                        "a pair or space naming it is registered (scd-store register)",
                        self.model, self.service.models())
            return
        layout = binding.space.layout
        layers, two, _, heads, dim = metadata.kv_shape
        if (layers, heads, dim) != layout.geometry or two != 2:
            raise SettingsError(f"engine KV shape {tuple(metadata.kv_shape)} (layers, 2, chunk, heads, head_dim) does "
                                f"not match space {binding.space.space_id!r}: {layout.num_layers} layers x "
                                f"{layout.kv_heads} heads x {layout.head_dim}")
        log.info("scd-store LMCache plugin: %r is the %s of space %r", self.model, binding.role,
                 binding.space.space_id)

    def __str__(self) -> str:
        return "ScdStoragePlugin"

    # ----------------------------------------------------------------- helpers
    def _is_adapter(self, name: str) -> bool:
        """Whether ``name`` is a registered consumer of the engine's own space (an adapter it may serve)."""
        engine, adapter = self.service.binding(self.model), self.service.binding(name)
        return engine is not None and adapter is not None and engine.role == Role.PRODUCER and \
            adapter.role == Role.CONSUMER and adapter.space.space_id == engine.space.space_id and \
            adapter.space.fingerprint == engine.space.fingerprint

    def _key_identity(self, key: CacheEngineKey) -> ChunkIdentity:
        return key_identity(key, self.model_tag, self.serves_adapters, self._is_adapter, self.service.aliases)

    def _identity(self, keys: Sequence[CacheEngineKey]) -> ChunkIdentity:
        """The batch's identity, with what it cannot be counted and logged once: salted requests and
        unattributed ones are neither stored nor served (``model`` None); an ignored model tag is counted."""
        identity = batch_identity(keys, self.model_tag, self.serves_adapters, self._is_adapter, self.service.aliases)
        count = self._incidents.count
        if identity.salted:
            count("salted_chunks", "scd-store: a request with a cache_salt (lmcache.tag.%s): LMCache's keys carry no "
                  "salt scd-store could keep tenants apart by, so it is neither stored nor served (counted as "
                  "salted_chunks; logged once)", SALT_TAG, n=len(keys), once="salted")
            return ChunkIdentity(None, salted=True)
        if identity.ignored_tag is not None:
            count("ignored_model_tags", "scd-store: a request tagged lmcache.tag.%s=%r on the engine of %r, which "
                  "serves no adapters: roles come from the engine, the tag is ignored (counted as ignored_model_tags; "
                  "logged once)", self.model_tag, identity.ignored_tag, self.model, once="ignored")
        if identity.model is None and not self.serves_adapters:
            count("unattributed_chunks", "scd-store: a batch of keys of several requests' identities: not stored or "
                  "served (counted as unattributed_chunks; logged once)", n=len(keys), once="mixed")
        elif identity.model is None:
            count("unattributed_chunks", "scd-store: a request whose lmcache.tag.%s names no registered consumer of "
                  "%r's space (untagged, the producer or another model) on an engine that serves adapters "
                  "(serves_adapters) cannot be attributed to a model: not stored or served (counted as "
                  "unattributed_chunks; logged once)", self.model_tag, self.model, n=len(keys), once="unattributed")
        return identity

    def _batch(self, keys: Sequence[CacheEngineKey], role: Role) -> ChunkIdentity | None:
        """The identity of a batch of ``role``'s (producer, consumer) keys; None when it is no such model's."""
        if not keys:
            return None
        identity = self._identity(keys)
        binding = self.service.binding(identity.model) if identity.model is not None else None
        return identity if binding is not None and binding.role == role else None

    @staticmethod
    def _hashes(keys: Sequence[CacheEngineKey], identity: ChunkIdentity) -> list[bytes]:
        return [chunk_hash_bytes(k.chunk_hash, identity.namespace) for k in keys]

    def _start(self, obj: MemoryObj) -> int | None:
        """The chunk's absolute start position from ``cached_positions``, or None when the engine gave
        none (or not one contiguous run of the chunk's length)."""
        positions = obj.metadata.cached_positions
        tokens = obj.tensor.shape[2] if obj.tensor is not None and obj.tensor.dim() == 4 else -1
        if positions is None or len(positions) != tokens or tokens <= 0:
            return None
        start = int(positions[0])
        if start < 0 or not torch.equal(positions.cpu().long(), torch.arange(start, start + tokens)):
            return None
        return start

    def _unpositioned(self, model: str, count: int) -> None:
        self._incidents.count("unpositioned_chunks", "scd-store: LMCache's GPU connector records no chunk positions "
                              "(MemoryObj.metadata.cached_positions), so chunks of %r cannot be coded at their true "
                              "positions and are not stored (counted as unpositioned_chunks; logged once). Use a "
                              "connector that records them (vLLM: scd_store.adapters.vllm.lmcache_gpu."
                              "LMCacheGpuConnector or lmcache_cpu.LMCacheCpuConnector; embedded: "
                              "scd_store.adapters.lmcache.dense_connector.DenseKVConnector)", model, n=count,
                              once="positions")

    # ----------------------------------------------------------------- StoragePluginInterface
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        identity = self._batch(keys, Role.CONSUMER)
        if identity is None:
            return 0
        return self.service.contains(identity.model, self._hashes(keys, identity),
                                     tokens=len(keys) * self.metadata.kv_shape[2])

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        identity = self._key_identity(key)
        if identity.model is None or identity.salted:
            return False
        return self.service.pending_put(chunk_hash_bytes(key.chunk_hash, identity.namespace))

    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj], transfer_spec: Any = None,
                                on_complete_callback: Callable[[CacheEngineKey], None] | None = None) -> None:
        """Hand the chunks to the put worker and return: they are converted, encoded and stored off the
        engine's thread, holding a reference on each memory object until then."""
        identity = self._batch(keys, Role.PRODUCER)  # never a producer on an engine that serves adapters
        if identity is None:
            return None  # consumers never write; their own chunks stay in LMCache's other tiers
        model = identity.model
        if any(obj.metadata.fmt != MemoryFormat.KV_2LTD for obj in objs):
            self._once.warn("fmt", "scd-store: LMCache chunk format %s is not supported (KV_2LTD only); not storing",
                            objs[0].metadata.fmt)
            return None
        starts = [self._start(obj) for obj in objs]
        if None in starts:
            self._unpositioned(model, len(keys))
            return None
        heads = self.metadata.kv_shape[3]
        for obj in objs:
            obj.ref_count_up()

        def states() -> list[KVState]:
            return [state_from_kv_2ltd(obj.tensor, heads, start) for obj, start in zip(objs, starts, strict=True)]

        def release() -> None:
            for obj in objs:
                obj.ref_count_down()

        def done(stored: int) -> None:
            if on_complete_callback is not None and stored:
                for key in keys[:stored]:
                    on_complete_callback(key)

        self.service.submit_put(model, self._hashes(keys, identity), states, release=release, done=done)
        return None

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted chunk is stored (or failed); False when ``timeout`` passed first."""
        return self.service.drain(timeout)

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = [None] * len(keys)
        identity = self._batch(keys, Role.CONSUMER)
        if identity is None:
            return out
        layers, _, _, heads, dim = self.metadata.kv_shape
        allocated: list[MemoryObj] = []
        batch = self.decode_target.batch(heads)

        def chunk_buffers(i: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
            # each chunk lands in its KV_2LTD memory object from LMCache's CPU allocator (decoded straight
            # into it, or on decode_device and copied in)
            shape = torch.Size([2, layers, tokens, heads * dim])
            obj = self.local_cpu_backend.allocate(shape, keys[i].dtype, fmt=MemoryFormat.KV_2LTD)
            if obj is None:
                self._once.warn("alloc", "scd-store: LMCache's CPU allocator is full; retrieved chunks dropped")
                return None
            allocated.append(obj)
            return batch.buffers(obj.tensor)

        try:
            with batch:  # every copy into the memory objects has landed when it closes, failed or not
                states = self.service.get(identity.model, self._hashes(keys, identity), into=chunk_buffers)
                batch.land(len(states))
        except BaseException:
            for obj in allocated:  # nothing handed out: the memory goes back before the error does
                obj.ref_count_down()
            raise
        for i, obj in enumerate(allocated):
            if i < len(states):
                out[i] = obj
            else:  # its chunk was refused by the codec: hand the memory back
                obj.ref_count_down()
        return out

    def get_non_blocking(self, key: CacheEngineKey, location: str | None = None) -> Future | None:
        return self._executor.submit(self.get_blocking, key)

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """:meth:`batched_contains` off LMCache's event loop (its async lookup path)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.batched_contains, keys, pin)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        """The leading run of :meth:`batched_get_blocking` off LMCache's event loop (its async load path)."""
        objs = await asyncio.get_running_loop().run_in_executor(self._executor, self.batched_get_blocking, keys)
        return list(itertools.takewhile(lambda obj: obj is not None, objs))

    def pin(self, key: CacheEngineKey) -> bool:
        return False  # codes are shared by every consumer of a space: nothing is pinned per engine

    def unpin(self, key: CacheEngineKey) -> bool:
        return False

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return False  # engines do not delete codes; the store's tiers evict by their own bounds

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=True)
        service, self.service = getattr(self, "service", None), None
        if service is not None:
            release_service(service)
