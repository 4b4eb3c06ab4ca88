"""LMCache under vLLM on CUDA: :class:`LMCacheGpuConnector`, vLLM's LMCache connector whose GPU connector records
chunk positions.

LMCache 0.5.6's vLLM GPU connectors (``VLLMPagedMemGPUConnectorV2``, and ``V3`` with
``use_gpu_connector_v3``) move ``KV_2LTD`` chunks out of vLLM's paged cache, handed each chunk's
absolute span of the request's tokens (``start``, ``end``), but record nothing in
``MemoryObj.metadata.cached_positions``: a producer behind them stores no codes. This connector is
LMCache's own (through :class:`~scd_store.adapters.vllm.lmcache_base.ScdLMCacheConnector`: salt
tags, the LoRA flag, the recompute policy); while it builds its LMCache engine, LMCache's own
factory makes :class:`PositionedPagedV2` / :class:`PositionedPagedV3` instead: those very classes,
whose ``from_gpu`` also records the chunk's positions once LMCache's copy has completed
(:func:`~scd_store.adapters.vllm.lmcache_base.record_positions`, as the CPU connector does).
LMCache's layerwise and blending connectors (``use_layerwise``, ``enable_blending``) stay its own
and record none: the plugin then stores nothing and counts ``unpositioned_chunks`` (logged at start
here). Launch::

    LMCACHE_CONFIG_FILE=lmcache.yaml python -m vllm.entrypoints.openai.api_server --model DIR
        --kv-transfer-config '{"kv_connector": "LMCacheGpuConnector",
            "kv_connector_module_path": "scd_store.adapters.vllm.lmcache_gpu", "kv_role": "kv_both"}'
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import lmcache.v1.gpu_connector.gpu_connectors as lmcache_connectors
from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2, VLLMPagedMemGPUConnectorV3

from scd_store.adapters.vllm.lmcache_base import ScdLMCacheConnector, patched, record_positions

log = logging.getLogger("scd_store.adapters.vllm")


class RecordsPositions:
    """A mixin for LMCache's GPU connectors: ``from_gpu`` records each chunk's absolute positions after
    LMCache's own copy (which has completed on return for host memory objects: LMCache synchronises
    its store stream)."""

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        super().from_gpu(memory_obj, start, end, **kwargs)  # type: ignore[misc]
        record_positions(memory_obj, start, end, kwargs.get("slot_mapping"))


class PositionedPagedV2(RecordsPositions, VLLMPagedMemGPUConnectorV2):
    """LMCache's ``VLLMPagedMemGPUConnectorV2`` that records chunk positions."""


class PositionedPagedV3(RecordsPositions, VLLMPagedMemGPUConnectorV3):
    """LMCache's ``VLLMPagedMemGPUConnectorV3`` that records chunk positions."""


def positioned_gpu_connectors() -> contextlib.AbstractContextManager[None]:
    """While open, LMCache's GPU connector factory builds :class:`PositionedPagedV2` / ``V3`` where it would
    build LMCache's ``V2`` / ``V3`` (its factory imports them from their module when it runs)."""
    return patched(lmcache_connectors, VLLMPagedMemGPUConnectorV2=PositionedPagedV2,
                   VLLMPagedMemGPUConnectorV3=PositionedPagedV3)


def engine_gpu_connector() -> Any:
    """The GPU connector of this process's LMCache engine for vLLM (None without one: the scheduler's)."""
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    engine = LMCacheEngineBuilder.get(ENGINE_NAME)
    return getattr(engine, "gpu_connector", None)


class LMCacheGpuConnector(ScdLMCacheConnector):
    """vLLM's LMCache connector on CUDA, whose LMCache engine records the positions of the chunks it stores."""

    device_type = "cuda"
    other_device_hint = "; on vLLM-CPU use scd_store.adapters.vllm.lmcache_cpu.LMCacheCpuConnector"

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        connector = engine_gpu_connector()
        if connector is not None and not isinstance(connector, RecordsPositions):
            log.warning("scd-store: LMCache built %s (use_layerwise / enable_blending), which records no chunk "
                        "positions: the scd-store plugin stores nothing from this engine (counted as "
                        "unpositioned_chunks). Turn both off for a producer",
                        type(connector).__name__)

    def gpu_connectors(self, vllm_config: Any) -> contextlib.AbstractContextManager[None]:
        """LMCache's factory makes :class:`PositionedPagedV2` / ``V3``."""
        return positioned_gpu_connectors()
