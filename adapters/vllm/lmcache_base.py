"""What scd-store's vLLM connectors for LMCache share (:class:`ScdLMCacheConnector`, the base of
:class:`~scd_store.adapters.vllm.lmcache_cpu.LMCacheCpuConnector` and
:class:`~scd_store.adapters.vllm.lmcache_gpu.LMCacheGpuConnector`).

Each is LMCache's own vLLM v1 connector (``LMCacheConnectorV1``), except that while it builds its
LMCache engine, LMCache's GPU connector factory makes a connector that records every stored chunk's
absolute positions in ``MemoryObj.metadata.cached_positions`` (:func:`record_positions`), which is
what the scd-store LMCache plugin stores a chunk at. Both also:

- tag a salted request's LMCache configs (:func:`tag_cache_salt`): LMCache's non-multiprocess keys
  carry no ``cache_salt``; ``lmcache.tag.scd_cache_salt`` (a SHA-256 prefix of vLLM's
  ``request.cache_salt``, set before LMCache's lookup and its request tracker read the configs; a
  client's value is overwritten, or removed from an unsalted request) keys them apart in LMCache's own
  tiers, and the scd-store plugin neither stores nor serves them;
- tell the plugin when vLLM serves LoRA adapters (:func:`mark_lora_engine`; LMCache keys carry no
  LoRA id, so such an engine never writes codes);
- set ``kv_load_failure_policy: recompute``: a code that cannot be decoded is recomputed by the engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

from scd_store.service.engine_facts import mark_serves_lora

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


def mark_lora_engine(vllm_config: Any) -> bool:
    """Tell the scd-store LMCache plugin of this process that its engine serves LoRA adapters (LMCache keys carry
    no LoRA id, so such an engine must never write codes); whether it does."""
    serves = getattr(vllm_config, "lora_config", None) is not None
    if serves:
        mark_serves_lora()
    return serves


def record_positions(memory_obj: Any, start: int, end: int, slot_mapping: Any) -> bool:
    """Record a stored chunk's absolute positions, ``start .. end - 1``, in ``memory_obj.metadata.cached_positions``;
    whether they could be established.

    LMCache's vLLM adapter stores a request's token sequence from position 0 (a mask skips the prefix
    already stored) with one slot per token of it, and hands its GPU connector each chunk's span of
    that sequence: ``slot_mapping[start:end]`` are the chunk's slots. So the span is the chunk's
    positions when it lies inside the slot mapping and spans the memory object's tokens; otherwise
    none are recorded (``None``: the plugin stores nothing and counts ``unpositioned_chunks``)."""
    tensor = getattr(memory_obj, "tensor", None)
    tokens = tensor.shape[2] if tensor is not None and tensor.dim() == 4 else -1
    known = slot_mapping is not None and 0 <= start < end <= len(slot_mapping) and end - start == tokens
    memory_obj.metadata.cached_positions = torch.arange(start, end) if known else None
    return known


@contextlib.contextmanager
def patched(module: ModuleType, **attributes: Any) -> Iterator[None]:
    """``module``'s ``attributes`` replaced while this is open (one LMCache engine is built at a time)."""
    with _factory_lock:
        originals = {name: getattr(module, name) for name in attributes}
        for name, value in attributes.items():
            setattr(module, name, value)
        try:
            yield
        finally:
            for name, value in originals.items():
                setattr(module, name, value)


class ScdLMCacheConnector(LMCacheConnectorV1):
    """vLLM's LMCache connector with scd-store's hooks; subclasses name their device (``device_type``) and say
    how LMCache's GPU connector is made while the engine is built (:meth:`gpu_connectors`)."""

    device_type: ClassVar[str]
    other_device_hint: ClassVar[str] = ""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        device = vllm_config.device_config.device_type
        if device != self.device_type:
            raise ValueError(f"{type(self).__name__} is for vLLM on {self.device_type}, not {device}"
                             f"{self.other_device_hint}")
        mark_lora_engine(vllm_config)
        # a code that cannot be decoded is recomputed by the engine, never a failed request
        vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
        with self.gpu_connectors(vllm_config):
            super().__init__(vllm_config, role, kv_cache_config)

    def gpu_connectors(self, vllm_config: Any) -> contextlib.AbstractContextManager[None]:
        """While open, LMCache's GPU connector factory makes connectors that record chunk positions."""
        raise NotImplementedError

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """LMCache's lookup, of the request's configs with its salt tag."""
        tag_cache_salt(request)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Tag the salt again before LMCache's request tracker reads the configs (a request may reach
        it without a lookup)."""
        tag_cache_salt(request)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
