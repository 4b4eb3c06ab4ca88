"""What the vLLM connector serves, refused at start with the reason otherwise: :func:`check_engine` (the
engine's config) and :func:`check_layers` (the attention layers and caches the worker registers).

Served: vLLM-CPU and CUDA (FlashAttention, FlashInfer, Triton attention), bf16 / fp16 / fp32 caches in
any ``KVCacheLayout``, consumers at any tensor-parallel size (each rank keeps its share of the heads of
codes that cover them all), pipeline parallel size 1. Refused: MLA (its latent cache is not a
model's K and V), quantised caches (fp8, nvfp4, ...: decoded codes would be rounded into a format
the consumer's decoder was not distilled for), KV-sharing layers (one cache, two layers' K and V),
other devices and backends (ROCm is not tested), speculative decoding (draft layers), more than one
KV cache group or a spec other than full attention (vLLM recovers failed loads only then), pipeline
parallelism (a code space covers all layers of the model), and a producer at tensor-parallel size > 1
(:func:`check_tensor_parallel`: a code space is fitted on every head, and a rank holds a share).
"""

from __future__ import annotations

from typing import Any

from scd_store.service import Role, SettingsError

DEVICES = ("cpu", "cuda")
BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
TENSOR_DTYPES = ("bfloat16", "float16", "float32")  # what a decoded code can be written into exactly
CACHE_DTYPES = ("auto", *TENSOR_DTYPES)  # --kv-cache-dtype values that give one of them


def check_engine(vllm_config: Any) -> None:
    """Refuse engines whose KV the connector cannot read and write exactly (a clear error at start)."""
    device = vllm_config.device_config.device_type
    if device not in DEVICES:
        raise SettingsError(f"scd-store's vLLM connector serves vLLM on {' or '.join(DEVICES)}; this server runs "
                            f"on {device!r}")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise SettingsError("scd-store's vLLM connector needs pipeline parallel size 1: a code space covers all "
                            "layers of the model")
    if getattr(vllm_config.model_config, "use_mla", False):
        raise SettingsError("scd-store's vLLM connector does not serve MLA models: their latent cache is not the "
                            "per-head K and V a code space rebuilds")
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype not in CACHE_DTYPES:
        raise SettingsError(f"scd-store's vLLM connector needs an unquantised KV cache (--kv-cache-dtype auto, "
                            f"bfloat16 or float16); this server caches in {cache_dtype!r}")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise SettingsError("scd-store's vLLM connector does not serve speculative decoding: the draft model's "
                            "KV layers are not the code space's")
    if device == "cuda" and _rocm():
        raise SettingsError("scd-store's vLLM connector is not tested on ROCm; this server runs on an AMD GPU")


def check_tensor_parallel(vllm_config: Any, role: Role | None, kv_role: str) -> None:
    """Refuse a producer at tensor-parallel size > 1 (``role``: the served model's binding role, None when it
    has none yet; ``kv_role``: vLLM's): its chunks would be stored from one rank's share of the heads."""
    size = vllm_config.parallel_config.tensor_parallel_size
    if size > 1 and (role == Role.PRODUCER or kv_role == "kv_producer"):
        raise SettingsError(f"scd-store's vLLM connector stores a producer's KV at tensor-parallel size 1 only (this "
                            f"server runs {size} ranks): a code space is fitted on every KV head, and a rank holds "
                            "a share; serve the producer with --tensor-parallel-size 1 (consumers may use any)")


def check_groups(kv_cache_config: Any) -> None:
    """One KV cache group of full attention (vLLM's invalid-block recovery, which a failed load relies on,
    serves no more; sliding-window and hybrid models are refused)."""
    if kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise SettingsError(f"scd-store's vLLM connector needs one KV cache group of full attention; this model has "
                            f"{kinds}")


def _rocm() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(getattr(current_platform, "is_rocm", lambda: False)())


def check_layers(names: list[str], layers: list[Any], caches: list[Any]) -> None:
    """Refuse attention layers the connector cannot move KV of: another backend, a layer that shares
    another's cache (the same tensor twice, or ``kv_sharing_target_layer_name``)."""
    seen: dict[int, str] = {}
    for name, layer, cache in zip(names, layers, caches, strict=True):
        if str(cache.dtype).removeprefix("torch.") not in TENSOR_DTYPES:
            raise SettingsError(f"scd-store's vLLM connector needs an unquantised KV cache; layer {name!r} caches in "
                                f"{cache.dtype}")
        backend = getattr(getattr(layer, "attn_backend", None), "get_name", lambda: None)()
        if backend is not None and backend not in BACKENDS:
            raise SettingsError(f"scd-store's vLLM connector serves the {', '.join(BACKENDS)} attention backends; "
                                f"layer {name!r} runs {backend!r}")
        shared = getattr(layer, "kv_sharing_target_layer_name", None)
        if shared is not None or id(cache) in seen:
            raise SettingsError(f"scd-store's vLLM connector does not serve KV-sharing layers: {name!r} shares the "
                                f"cache of {shared or seen[id(cache)]!r}")
        seen[id(cache)] = name
