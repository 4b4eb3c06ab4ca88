"""Host pools the SGLang backend refuses: any that does not hold plain float KV (SGLang's fp8 pools store
uint8 bytes, mxfp8 fp8 with block scales, fp4 packed bytes), K and V of other head sizes, odd layouts.

The pools are :mod:`tests.adapters.sglang.host_pool`'s stand-in (SGLang's host pool classes do not import on
this CPU); the dtype a ``--kv-cache-dtype`` value gives comes from SGLang's own ``configure_kv_cache_dtype``
where SGLang is installed."""

from __future__ import annotations

import pytest
import torch

from scd_store.adapters.sglang.pool_check import check_host_pool
from scd_store.service import SettingsError
from tests.adapters.sglang.host_pool import D, HostPool, MXFP8HostPool, store_dtype

# SGLang 0.5.23's --kv-cache-dtype choices (srt/arg_groups/fields/model.py) and whether a pool of it is served
KV_CACHE_DTYPES = {"auto": True, "bf16": True, "bfloat16": True, "fp8_e4m3": False, "fp8_e5m2": False,
                   "mxfp8": False, "nvfp4": False, "fp4_mx_block16": False}
REFUSED = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.float8_e4m3fnuz, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.complex64, torch.float64]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_pools_of_plain_float_kv_are_served(layout, dtype):
    check_host_pool(HostPool(layout, dtype=dtype))


@pytest.mark.parametrize("dtype", REFUSED, ids=str)
def test_a_pool_of_any_other_dtype_is_refused_with_what_to_set(dtype):
    with pytest.raises(SettingsError, match=rf"host pool dtype {dtype} is not one .*--kv-cache-dtype bf16"):
        check_host_pool(HostPool(dtype=dtype))


def test_an_mxfp8_pool_is_refused_and_so_are_its_scales_even_under_a_float_dtype():
    with pytest.raises(SettingsError, match="host pool dtype torch.float8_e4m3fn"):
        check_host_pool(MXFP8HostPool())
    disguised = MXFP8HostPool()
    disguised.dtype = torch.bfloat16  # a pool that keeps scales is quantised whatever its dtype says
    with pytest.raises(SettingsError, match=r"keeps KV scales \(k_scale_host, v_scale_host\).*--kv-cache-dtype"):
        check_host_pool(disguised)


def test_asymmetric_head_sizes_and_unknown_layouts_are_refused():
    asymmetric = HostPool()
    asymmetric.v_head_dim = 2 * D  # SGLang's AsymmetricMHATokenToKVPoolHost
    with pytest.raises(SettingsError, match=f"K head_dim {D} and V head_dim {2 * D} differ"):
        check_host_pool(asymmetric)
    odd = HostPool()
    odd.layout = "page_unified"
    with pytest.raises(SettingsError, match="layout 'page_unified' is not supported"):
        check_host_pool(odd)


@pytest.mark.parametrize("choice, served", sorted(KV_CACHE_DTYPES.items()))
@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16])
def test_sglang_kv_cache_dtypes_give_pools_served_only_when_they_hold_float_kv(choice, served, model_dtype):
    """The pool dtype of each ``--kv-cache-dtype`` value, derived as SGLang derives it."""
    pytest.importorskip("sglang", reason="SGLang's own dtype mapping needs the SGLang stack (`make test`)")
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype

    _, kv_dtype = configure_kv_cache_dtype(server_args_kv_cache_dtype=choice, model=None, model_dtype=model_dtype,
                                           is_draft_worker=False, is_dflash=False,
                                           speculative_draft_attention_backend=None)
    pool = MXFP8HostPool() if choice == "mxfp8" else HostPool(dtype=store_dtype(kv_dtype))
    if served:
        check_host_pool(pool)
    else:
        with pytest.raises(SettingsError, match="--kv-cache-dtype bf16"):
            check_host_pool(pool)
