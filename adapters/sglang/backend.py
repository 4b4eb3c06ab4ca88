"""scd-store as an SGLang HiCache L3 backend (``HiCacheStorage``; SGLang 0.5.23).

Launch flags::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "scd",
        "module_path": "scd_store.adapters.sglang.backend", "class_name": "ScdHiCacheStorage",
        "interface_v1": 1, "scd": {"bundles": ["/path/to/bundle"], "store_config": "/path/to/scd-store.yaml"}}'

Pages a space's producer writes back are encoded into its code space and stored under SGLang's
page key; a registered consumer's prefetch of the same keys gets the codes decoded into its own
KV, written into its host pool. Positions come from ``extra_info.prefix_keys`` (the pages before
the call's keys). Unknown models and producers reading their own pages miss (their L3 is raw).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from scd_store.adapters.sglang.pages import LAYOUTS, flat_page, page_hash_bytes, read_page, state_from_flat, write_page
from scd_store.codecs.kv_state import KVState
from scd_store.service import EngineSettings, SettingsError, acquire_service, release_service

log = logging.getLogger("scd_store.adapters.sglang")
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")


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
                                    '"store_config", "aliases", "positions")')
            settings = EngineSettings.from_mapping(scd)
            self.positions = settings.positions
            self.model = storage_config.model_name or ""
            self.service = acquire_service(settings)
        except Exception as exc:
            log.error("scd-store SGLang backend: bad configuration: %s", exc)
            raise
        self.binding = self.service.binding(self.model)
        if self.binding is None:
            log.warning("scd-store SGLang backend: model %r is in no bundle (bound: %s); every request misses",
                        self.model, self.service.models())
        self.mem_pool_host: Any = None
        self._warned: set[str] = set()

    # ----------------------------------------------------------------- set-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in LAYOUTS:
            raise SettingsError(f"host pool layout {layout!r} is not supported (supported: {LAYOUTS})")
        if self.binding is not None:
            got = (mem_pool_host.layer_num, mem_pool_host.head_num, mem_pool_host.head_dim)
            if got != self.binding.space.layout.geometry:
                raise SettingsError(f"host pool (layers, heads, head_dim) {got} does not match space "
                                    f"{self.binding.space.space_id!r}: {self.binding.space.layout.geometry}")
        self.mem_pool_host = mem_pool_host

    def _role(self) -> str:
        return self.binding.role if self.binding is not None else ""

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)

    def _first_position(self, extra_info: HiCacheStorageExtraInfo | None) -> int | None:
        page = self.mem_pool_host.page_size
        if extra_info is not None and extra_info.prefix_keys is not None:
            return len(extra_info.prefix_keys) * page
        if self.positions == "batch":
            return 0
        self._warn_once("positions", "scd-store: SGLang gave no prefix_keys, so page positions are unknown; not "
                        "storing. Set scd.positions to batch when whole prompts are always written from page 0")
        return None

    def _pool_ready(self) -> bool:
        if self.mem_pool_host is None:
            self._warn_once("pool", "scd-store: no host pool registered yet; miss")
            return False
        return True

    # ----------------------------------------------------------------- zero-copy v1 interface
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if self._role() != "consumer" or not keys:
            return 0
        return self.service.contains(self.model, [page_hash_bytes(k) for k in keys])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if self._role() != "producer" or not keys or not self._pool_ready():
            return [False] * len(keys)
        start = self._first_position(extra_info)
        if start is None:
            return [False] * len(keys)
        page = self.mem_pool_host.page_size
        states = [read_page(self.mem_pool_host, int(host_indices[i * page]), start + i * page)
                  for i in range(len(keys))]
        return [self._put(keys, states)] * len(keys)

    def _put(self, keys: list[str], states: list[KVState]) -> bool:
        try:
            return self.service.put(self.model, [page_hash_bytes(k) for k in keys], states) == len(keys)
        except ValueError as exc:  # KV the space cannot code: nothing is stored, the engine goes on
            log.warning("scd-store: not storing %d pages of %r: %s", len(keys), self.model, exc)
            return False

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if self._role() != "consumer" or not keys or not self._pool_ready():
            return [False] * len(keys)
        page = self.mem_pool_host.page_size
        states = self.service.get(self.model, [page_hash_bytes(k) for k in keys])
        for i, state in enumerate(states):
            write_page(self.mem_pool_host, int(host_indices[i * page]), state)
        return [True] * len(states) + [False] * (len(keys) - len(states))

    # ----------------------------------------------------------------- flat-page interface
    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
                  ) -> list[torch.Tensor | None]:
        if self._role() != "consumer" or not keys or not self._pool_ready():
            return [None] * len(keys)
        states = self.service.get(self.model, [page_hash_bytes(k) for k in keys])
        out: list[torch.Tensor | None] = [None] * len(keys)
        for i, state in enumerate(states):
            flat = flat_page(state, self.mem_pool_host.layout, self.mem_pool_host.dtype)
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
        """Flat pages in the pool's layout; positions only in ``batch`` mode (this call has no prefix info)."""
        if self._role() != "producer" or not keys or values is None or not self._pool_ready():
            return False
        start = self._first_position(None)
        if start is None:
            return False
        pool = self.mem_pool_host
        states: list[KVState] = [state_from_flat(v, pool.layout, pool.layer_num, pool.head_num, pool.head_dim,
                                                 start + i * pool.page_size) for i, v in enumerate(values)]
        return self._put(keys, states)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def clear(self) -> None:
        self._warn_once("clear", "scd-store: clear() is ignored: codes are shared by every consumer of a space")

    def get_stats(self) -> dict:
        return self.service.store.stats.snapshot() if self.service is not None else {}

    def close(self) -> None:
        service, self.service = getattr(self, "service", None), None
        if service is not None:
            release_service(service)
