"""Shared fixtures for the fast unit tests: tiny random-init Llama models, no downloads."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0, layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         rope_theta=100000.0, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every device present: the CPU always, CUDA where available."""
    return request.param


@pytest.fixture
def tiny_model(device) -> LlamaForCausalLM:
    return tiny_llama().to(device)


@pytest.fixture
def kv_state():
    from scd_store.codecs import KVState

    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 2, 40, 16, generator=generator) * 3
    values = torch.randn(3, 2, 40, 16, generator=generator)
    return KVState(keys, values)
