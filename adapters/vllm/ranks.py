"""This worker's tensor-parallel share of the KV heads, from vLLM's own parallel state: :func:`rank_heads`."""

from __future__ import annotations

from typing import Any

from scd_store.codecs.head_share import HeadShare


def rank_heads(vllm_config: Any, rank: int | None = None) -> HeadShare | None:
    """The KV heads this worker's cache holds (None at tensor-parallel size 1: all of them). ``rank``: the
    tensor-parallel rank (default: vLLM's ``get_tensor_model_parallel_rank()`` of this process)."""
    size = vllm_config.parallel_config.tensor_parallel_size
    if size <= 1:
        return None
    if rank is None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
    return HeadShare.of_rank(rank, size, vllm_config.model_config.get_total_num_kv_heads())
