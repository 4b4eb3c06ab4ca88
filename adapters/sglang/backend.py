"""scd-store as an SGLang HiCache L3 backend: :class:`ScdHiCacheStorage` (``HiCacheStorage``; SGLang 0.5.23).

Launch flags::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "scd",
        "module_path": "scd_store.adapters.sglang.backend", "class_name": "ScdHiCacheStorage",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
        "scd": {"bundles": ["/path/to/bundle"], "store_config": "/path/to/scd-store.yaml"}}'

Pages a space's producer writes back are copied out of the host pool, handed to scd-store's put
worker (the call returns at once), encoded into its code space and stored under SGLang's page key;
a registered consumer's prefetch of the same keys gets the codes decoded into its own KV, written
into its host pool. Positions come from ``extra_info.prefix_keys`` (the pages before the call's
keys), which SGLang passes only with ``hicache_storage_pass_prefix_keys: true``: without it the
backend refuses to start. Unknown models and producers reading their own pages miss (their L3 is raw).

``decode_device`` (``"scd"`` key; default ``cpu``) says where a consumer's codes are decoded: on the CPU in
SGLang's prefetch thread, or on a CUDA device, page by page on a stream of that thread's own, synchronised
before the pages are copied into the host pool (:mod:`~scd_store.adapters.sglang.device`). A host pool that does not
hold plain float KV (SGLang's fp8, mxfp8 and fp4 KV caches) is refused when SGLang registers it
(:mod:`~scd_store.adapters.sglang.pool_check`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from scd_store.adapters.sglang.device import DeviceDecode, device_decode
from scd_store.adapters.sglang.hashing import sglang_canary
from scd_store.adapters.sglang.pages import page_hash_bytes, read_page
from scd_store.adapters.sglang.pool_check import check_host_pool
from scd_store.codecs.kv_state import KVState
from scd_store.service import EngineSettings, Role, SettingsError, acquire_service, release_service
from scd_store.service.log_once import LogOnce

log = logging.getLogger("scd_store.adapters.sglang")
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
PREFIX_KEYS_FLAG = "hicache_storage_pass_prefix_keys"


def engine_serves_lora() -> bool:
    """Whether the running SGLang server serves LoRA adapters (False outside a server)."""
    try:
        from sglang.srt.runtime_context import get_lora

        return bool(get_lora().enable_lora)
    except Exception:
        return False


def engine_extra_config(storage_config: HiCacheStorageConfig) -> dict:
    """The storage extra config as the operator wrote it: SGLang pops its own keys (the prefix-keys
    flag among them) before it builds the backend, so inside a server read the published original."""
    try:
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.runtime_context import get_memory

        raw = get_memory().hicache_storage_backend_extra_config
    except Exception:  # not inside a running server (e.g. the factory called directly)
        raw = None
    if raw:
        extra, *_, flag = HybridCacheController.parse_storage_backend_extra_config(raw)
        return {**extra, PREFIX_KEYS_FLAG: flag}
    return dict(storage_config.extra_config or {})


class ScdHiCacheStorage(HiCacheStorage):
    """HiCache storage over scd-store's :class:`~scd_store.service.KVService`."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        try:
            if storage_config.tp_size != 1:
                raise SettingsError(f"tensor parallel engines (tp_size={storage_config.tp_size}) are not supported: "
                                    "codes are calibrated over all KV heads of a layer")
            if storage_config.is_mla_model:
                raise SettingsError("MLA models are not supported")
            extra = dict(storage_config.extra_config or {})
            scd = extra.get("scd")
            if not isinstance(scd, dict):
                raise SettingsError('the extra config needs an "scd" object with "bundles" (and optionally '
                                    '"store_config", "aliases", "put_queue_chunks", "get_deadline_s")')
            if engine_extra_config(storage_config).get(PREFIX_KEYS_FLAG) is not True:
                raise SettingsError(f'set "{PREFIX_KEYS_FLAG}": true in --hicache-storage-backend-extra-config: '
                                    "without it SGLang gives a backend no page positions, and scd-store codes "
                                    "pages at their true positions only")
            settings = EngineSettings.from_mapping(scd)
            self.decode: DeviceDecode = device_decode(settings.decode_device)
            # SGLang hands a storage backend no request identity: an adapter's pages cannot be told from the base's
            self.serves_adapters = settings.serves_adapters or engine_serves_lora()
            self.model = storage_config.model_name or ""
            self.service = acquire_service(settings)
        except Exception as exc:
            log.error("scd-store SGLang backend: bad configuration: %s", exc)
            raise
        self.binding = self.service.binding(self.model)
        if self.binding is None:
            log.warning("scd-store SGLang backend: model %r is in no bundle (bound: %s); its requests miss until "
                        "a pair or space naming it is registered (scd-store register)",
                        self.model, self.service.models())
        self.mem_pool_host: Any = None
        self._once = LogOnce(log)
        self._incidents = self.service.incidents(log)

    # ----------------------------------------------------------------- set-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Check and keep SGLang's host pool. A pool scd-store cannot serve exactly (its layout, a quantised
        dtype, another geometry or page hashing than the space's) fails SGLang's start (or a runtime attach)
        with the reason, logged too: a page is never read or written through it."""
        try:
            check_host_pool(mem_pool_host)
            if self.binding is not None:
                self._check_geometry(mem_pool_host, self.binding)
                self.service.check_hashing(self.model, sglang_canary(mem_pool_host.page_size))
        except SettingsError as exc:
            log.error("scd-store SGLang backend: %s", exc)
            raise
        self.mem_pool_host = mem_pool_host

    @staticmethod
    def _check_geometry(mem_pool_host: Any, binding: Any) -> None:
        got = (mem_pool_host.layer_num, mem_pool_host.head_num, mem_pool_host.head_dim)
        if got != binding.space.layout.geometry:
            raise SettingsError(f"host pool (layers, heads, head_dim) {got} does not match space "
                                f"{binding.space.space_id!r}: {binding.space.layout.geometry}")

    def _role(self) -> Role | None:
        if self.binding is None:  # registered after start (scd-store register): bound by discovery
            binding = self.service.binding(self.model)
            if binding is None:
                return None
            if self.mem_pool_host is not None:
                try:
                    self._check_geometry(self.mem_pool_host, binding)
                except SettingsError as exc:
                    self._once.warn("late-geometry", "scd-store SGLang backend: %s; not serving it", exc)
                    return None
            self.binding = binding
        return self.binding.role

    def _first_position(self, extra_info: HiCacheStorageExtraInfo | None, pages: int) -> int | None:
        if extra_info is not None and extra_info.prefix_keys is not None:
            return len(extra_info.prefix_keys) * self.mem_pool_host.page_size
        self._incidents.count("unpositioned_chunks", "scd-store: SGLang gave no prefix_keys, so page positions are "
                              'unknown; not storing (counted as unpositioned_chunks; logged once). Set "%s": true',
                              PREFIX_KEYS_FLAG, n=pages, once="positions")
        return None

    def _pool_ready(self) -> bool:
        if self.mem_pool_host is None:
            self._once.warn("pool", "scd-store: no host pool registered yet; miss")
            return False
        return True

    # ----------------------------------------------------------------- zero-copy v1 interface
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if self._role() != Role.CONSUMER or not keys:
            return 0
        page = self.mem_pool_host.page_size if self.mem_pool_host is not None else None
        return self.service.contains(self.model, [page_hash_bytes(k) for k in keys],
                                     tokens=len(keys) * page if page else None)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if self._role() != Role.PRODUCER or not keys or not self._pool_ready():
            return [False] * len(keys)
        if self.serves_adapters:
            self._incidents.count("unattributed_chunks", "scd-store: this SGLang server serves LoRA adapters, and "
                                  "SGLang gives a storage backend no request identity, so an adapter's pages cannot "
                                  "be told from the base model's: not storing (counted as unattributed_chunks; "
                                  "logged once). Produce from a server without --enable-lora", n=len(keys),
                                  once="adapters")
            return [False] * len(keys)
        start = self._first_position(extra_info, len(keys))
        if start is None:
            return [False] * len(keys)
        page = self.mem_pool_host.page_size
        # the host pages are SGLang's to reuse once this returns: copy them out now, encode off this thread
        states = [read_page(self.mem_pool_host, int(host_indices[i * page]), start + i * page)
                  for i in range(len(keys))]
        return [self._put(keys, states)] * len(keys)

    def _put(self, keys: list[str], states: list[KVState]) -> bool:
        """Hand the pages to the put worker; True when they were queued (stored or not, a later
        ``batch_exists`` says what is there)."""
        nbytes = sum(s.keys.numel() * s.keys.element_size() * 2 for s in states)
        return self.service.submit_put(self.model, [page_hash_bytes(k) for k in keys], lambda: states, nbytes=nbytes)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued page is stored (or failed); False when ``timeout`` passed first."""
        return self.service.drain(timeout)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if self._role() != Role.CONSUMER or not keys or not self._pool_ready():
            return [False] * len(keys)
        page = self.mem_pool_host.page_size
        pages = self._decoded_pages(keys)
        for i, flat in enumerate(pages):
            self.mem_pool_host.set_from_flat_data_page(int(host_indices[i * page]), flat)
        return [True] * len(pages) + [False] * (len(keys) - len(pages))

    def _decoded_pages(self, keys: list[str]) -> list[torch.Tensor]:
        """The consumer's decodes of the leading run of ``keys`` held, as flat host pages in the pool's layout
        and dtype, decoded on ``decode_device`` and complete when this returns."""
        return self.decode.read(self.service, self.model, [page_hash_bytes(k) for k in keys], self.mem_pool_host)

    # ----------------------------------------------------------------- flat-page interface
    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
                  ) -> list[torch.Tensor | None]:
        if self._role() != Role.CONSUMER or not keys or not self._pool_ready():
            return [None] * len(keys)
        out: list[torch.Tensor | None] = [None] * len(keys)
        for i, flat in enumerate(self._decoded_pages(keys)):
            target = target_locations[i] if target_locations is not None else None
            if isinstance(target, torch.Tensor):
                target.view(-1).copy_(flat)
                flat = target
            out[i] = flat
        return out

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        targets = [target_location] if target_location is not None else None
        return self.batch_get([key], targets)[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Flat pages without prefix information: their positions are unknown, so nothing is stored
        (counted); SGLang's zero-copy v1 path (``interface_v1``) carries them."""
        if self._role() != Role.PRODUCER or not keys or values is None or not self._pool_ready():
            return False
        return self._first_position(None, len(keys)) is not None

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def clear(self) -> None:
        self._once.warn("clear", "scd-store: clear() is ignored: codes are shared by every consumer of a space")

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (``--enable-storage-metrics`` adds ``prefetch_stats`` to it), with
        scd-store's counters as ``scd_store``; None where SGLang's metrics module does not import (SGLang
        then makes its own). scd-store's counters are also in its Prometheus registry and ``scd-store stats``."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:  # e.g. its multimodal imports need torchvision
            return None
        metrics = StorageMetrics()
        metrics.scd_store = self.service.stats_snapshot() if self.service is not None else {}
        return metrics

    def close(self) -> None:
        service, self.service = getattr(self, "service", None), None
        if service is not None:
            release_service(service)
