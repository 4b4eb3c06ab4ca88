"""An LMCache GPU connector over one dense KV tensor ``[2, layers, tokens, heads * head_dim]``, on any device:
:class:`DenseKVConnector`.

LMCache's own connectors move chunks between its memory objects and an engine's paged KV cache,
and never record where a chunk sits in its sequence. This one records every stored chunk's
absolute positions in ``MemoryObj.metadata.cached_positions`` (LMCache's own field for it), which
is where the scd-store plugin reads a chunk's position from: it is what an embedding application
(one sequence's KV in one tensor, e.g. from a transformers prefill) hands to ``LMCacheEngineBuilder``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface


class DenseKVConnector(GPUConnectorInterface):
    """Moves chunks between LMCache memory objects (``KV_2LTD``) and ``kv`` (``[2, L, T, H*D]``)."""

    def __init__(self, kv: torch.Tensor) -> None:
        if kv.dim() != 4 or kv.shape[0] != 2:
            raise ValueError(f"kv must be [2, layers, tokens, heads * head_dim], got {tuple(kv.shape)}")
        self.kv = kv

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.kv[:, :, start:end] = memory_obj.tensor.to(self.kv.device, self.kv.dtype)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(self.kv[:, :, start:end])
        memory_obj.metadata.cached_positions = torch.arange(start, end)

    def batched_to_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                       **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end)

    def batched_from_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                         **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.kv.shape[1], num_tokens, self.kv.shape[3]])
