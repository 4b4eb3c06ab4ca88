"""Shared fixtures for the fast unit tests: tiny random-init Llama models, no downloads; and the gates of tests
that need what the lent GPU machine's package set may lack (``cryptography``, a working Triton interpreter)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

T = TypeVar("T")


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


# Signed blobs need `cryptography` (imported by scd_store.store.signing on first use only); the lent GPU machine
# has none unless the device check carries its wheel (benchmarks/device_check.sh, WHEELS).
try:
    from cryptography.hazmat.primitives.asymmetric import ed25519 as _ed25519  # noqa: F401

    HAS_CRYPTOGRAPHY = True
except ImportError:
    HAS_CRYPTOGRAPHY = False
NO_CRYPTOGRAPHY = "signs or verifies blobs: needs the 'cryptography' package, which is not installed"
needs_cryptography = pytest.mark.skipif(not HAS_CRYPTOGRAPHY, reason=NO_CRYPTOGRAPHY)


def skip_without_cryptography() -> None:
    """Skip where ``cryptography`` is missing: the calling test module whole (called at its top, before its
    module-level keys), or every test of a fixture that makes keys (called in the fixture)."""
    if not HAS_CRYPTOGRAPHY:
        pytest.skip(NO_CRYPTOGRAPHY, allow_module_level=True)


def skip_where_the_store_cannot_sign() -> None:
    """For a test whose store signs with the host keyring (a disk tier, as the default store has): skip where
    ``cryptography`` is missing, unless ``SCD_STORE_ALLOW_UNSIGNED`` is true (the device check sets it where
    the package is missing: such stores then run unsigned, which these tests do not look at)."""
    from scd_store.flags import parse_flag

    if not HAS_CRYPTOGRAPHY and not parse_flag(os.environ.get("SCD_STORE_ALLOW_UNSIGNED", "0"),
                                               "SCD_STORE_ALLOW_UNSIGNED"):
        pytest.skip(NO_CRYPTOGRAPHY + " (or set SCD_STORE_ALLOW_UNSIGNED=1 to run its store unsigned)")


def with_cryptography(make: Callable[[], T], otherwise: T) -> T:
    """``make()`` where ``cryptography`` is installed, else ``otherwise``: module-level signing keys of a module
    that other modules import from, or that holds unsigned tests too (its signed tests carry
    ``needs_cryptography``), so that it still imports without it."""
    return make() if HAS_CRYPTOGRAPHY else otherwise


# Triton's interpreter (TRITON_INTERPRET=1, the fused kernels' CPU tests): Triton 3.6's breaks on NumPy >= 2.4
# (a loop over a runtime bound takes int() of a 1-element array), the lent GPU machine's pairing. A probe kernel
# with such a loop, in a subprocess (the interpreter is chosen at import), says whether it works here.
_INTERPRETER_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def k(x, y, n, B: tl.constexpr):
    acc = tl.zeros((B,), dtype=tl.float32)
    for c in range(0, n, B):
        i = c + tl.arange(0, B)
        acc += tl.load(x + i, mask=i < n, other=0.0)
    tl.store(y + tl.arange(0, B), acc)
x, y = torch.arange(10, dtype=torch.float32), torch.empty(8)
k[(1,)](x, y, 10, B=8)
assert y.tolist() == [8.0, 10.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], y
"""


@functools.cache
def triton_interpreter_problem() -> str | None:
    """None where Triton's interpreter runs the probe kernel right; else why not (a skip reason)."""
    try:
        import numpy
        import triton
    except ImportError:
        return "needs triton"
    done = subprocess.run([sys.executable, "-c", _INTERPRETER_PROBE], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return (f"Triton {triton.__version__}'s interpreter does not work with NumPy {numpy.__version__} "
            f"(Triton 3.6's breaks on NumPy >= 2.4): {last[-200:]}")


def skip_without_triton_interpreter() -> None:
    """Skip the calling test where Triton's interpreter does not work with the NumPy present."""
    problem = triton_interpreter_problem()
    if problem is not None:
        pytest.skip(problem)
