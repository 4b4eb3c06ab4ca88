"""Engines the vLLM connector cannot move KV of exactly are refused at start, with the reason."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.adapters.vllm.engine_check import check_engine, check_layers, check_tensor_parallel  # noqa: E402
from scd_store.adapters.vllm.ranks import rank_heads  # noqa: E402
from scd_store.codecs.head_share import HeadShare  # noqa: E402
from scd_store.service import SettingsError  # noqa: E402


def config(device="cpu", tp=1, pp=1, mla=False, cache_dtype="auto", kv_heads=8):
    return SimpleNamespace(device_config=SimpleNamespace(device_type=device),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                           model_config=SimpleNamespace(use_mla=mla, get_total_num_kv_heads=lambda: kv_heads),
                           cache_config=SimpleNamespace(cache_dtype=cache_dtype))


def test_cpu_and_cuda_engines_with_unquantised_caches_are_served():
    for device in ("cpu", "cuda"):
        for dtype in ("auto", "bfloat16", "float16"):
            check_engine(config(device, cache_dtype=dtype))


@pytest.mark.parametrize("kwargs,match", [({"device": "xpu"}, "'xpu'"), ({"pp": 2}, "parallel"), ({"mla": True}, "MLA"),
                                          ({"cache_dtype": "fp8"}, "unquantised.*'fp8'"),
                                          ({"cache_dtype": "fp8_e5m2"}, "fp8_e5m2"),
                                          ({"cache_dtype": "nvfp4"}, "nvfp4")])
def test_what_it_cannot_serve_is_refused_with_the_reason(kwargs, match):
    with pytest.raises(SettingsError, match=match):
        check_engine(config(**kwargs))


def test_consumers_are_served_at_any_tensor_parallel_size_and_producers_at_one():
    for tp in (2, 4, 8):
        check_engine(config("cuda", tp=tp))
        check_tensor_parallel(config("cuda", tp=tp), "consumer", "kv_both")
        check_tensor_parallel(config("cuda", tp=tp), None, "kv_consumer")  # a model registered later
    check_tensor_parallel(config(tp=1), "producer", "kv_producer")
    for role, kv_role in (("producer", "kv_both"), (None, "kv_producer"), ("consumer", "kv_producer")):
        with pytest.raises(SettingsError, match="tensor-parallel size 1"):
            check_tensor_parallel(config(tp=2), role, kv_role)


def test_each_rank_holds_the_heads_vllm_shards_to_it():
    assert rank_heads(config(tp=1)) is None
    assert [rank_heads(config(tp=4), r) for r in range(4)] == [HeadShare(2 * r, 2, 8) for r in range(4)]
    # more ranks than KV heads: vLLM replicates each head over tp // heads ranks (rank // replicas)
    assert [rank_heads(config(tp=6, kv_heads=3), r).first for r in range(6)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        rank_heads(config(tp=3, kv_heads=8), 0)  # 8 heads do not split over 3 ranks (vLLM refuses it too)


def _layer(backend="FLASH_ATTN", shares=None):
    return SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend), kv_sharing_target_layer_name=shares)


def test_layers_of_other_backends_or_sharing_a_cache_are_refused():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    a, b = torch.zeros(2, 2, 16, 8), torch.zeros(2, 2, 16, 8)
    for backend in (CPUAttentionBackend, FlashAttentionBackend, TritonAttentionBackend):  # vLLM's own names
        check_layers(["l.0.", "l.1."], [_layer(backend.get_name())] * 2, [a, b])
    with pytest.raises(SettingsError, match="'FLEX_ATTENTION'"):
        check_layers(["l.0."], [_layer("FLEX_ATTENTION")], [a])
    with pytest.raises(SettingsError, match="KV-sharing.*'l.0.'"):
        check_layers(["l.0.", "l.1."], [_layer(), _layer(shares="l.0.")], [a, b])
    with pytest.raises(SettingsError, match="KV-sharing.*'l.0.'"):  # the runner aliases a shared layer's tensor
        check_layers(["l.0.", "l.1."], [_layer(), _layer()], [a, a])


def test_one_group_of_full_attention_is_served_and_others_are_refused():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from scd_store.adapters.vllm.engine_check import check_groups

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, sliding_window=64)

    def config(*specs):
        return KVCacheConfig(num_blocks=4, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec([f"l.{i}."], s) for i, s in enumerate(specs)])

    check_groups(config(full))
    check_groups(None)  # vLLM did not say: nothing to check here (the layers are checked at registration)
    with pytest.raises(SettingsError, match="one KV cache group of full attention.*SlidingWindowSpec"):
        check_groups(config(window))
    with pytest.raises(SettingsError, match="one KV cache group"):
        check_groups(config(full, window))


def test_speculative_decoding_and_quantised_cache_tensors_are_refused():
    engine = config()
    engine.speculative_config = SimpleNamespace(method="eagle")
    with pytest.raises(SettingsError, match="speculative"):
        check_engine(engine)
    with pytest.raises(SettingsError, match="unquantised.*uint8"):
        check_layers(["l.0."], [_layer()], [torch.zeros(2, 2, 16, 8, dtype=torch.uint8)])
