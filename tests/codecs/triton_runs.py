"""Triton kernels where no GPU is: run under Triton's interpreter in a child process, or compiled by Triton's
NVIDIA back end for sm_90. Each skips the calling test, with its reason, where this machine cannot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import skip_without_triton_interpreter

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a child Python with ``TRITON_INTERPRET=1``, from the repository root: a kernel that writes out
    of bounds kills the child, not the test run."""
    pytest.importorskip("triton")
    skip_without_triton_interpreter()
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def interpreter_results(module: str) -> dict[str, str]:
    """``module.run_interpreter_checks()`` under the interpreter: its last JSON line, each case's "ok" or why not."""
    done = run_interpreted(f"from {module} import run_interpreter_checks; run_interpreter_checks()")
    # a 32-bit offset wraps negative: the interpreter writes outside the storage and the process dies (SIGSEGV)
    assert done.returncode == 0 and done.stdout.strip(), f"{done.stdout[-200:]} rc {done.returncode}: " \
        f"{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def sm90_compiler() -> Callable[[Any, list[str], dict[str, Any], str], Any]:
    """A compile function through Triton's NVIDIA pipeline for sm_90 (no GPU needed): ``(kernel, pointer types,
    constexprs, the type of every other argument)`` -> the compiled kernel."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter is on: nothing compiles")
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if "nvidia" not in backends:
        pytest.skip("Triton without its NVIDIA backend")

    def compile_kernel(kernel: Any, pointers: list[str], constexprs: dict[str, Any], scalar: str) -> Any:
        names = [n for n in kernel.arg_names if n not in constexprs]
        signature = dict(zip(names, pointers + [scalar] * (len(names) - len(pointers)), strict=True))
        signature.update({n: "constexpr" for n in constexprs})
        return triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))

    return compile_kernel


def paged_kernels() -> list[tuple[Any, list[str], dict[str, Any]]]:
    """The paged decode and scatter kernels with the pointer types and constexprs a compile needs."""
    from scd_store.codecs.scd import paged_fused

    decode, scatter = paged_fused._kernels()
    return [(decode, ["*u8", "*i64", "*fp16", "*fp32", "*fp32", "*fp32", "*bf16", "*i64", "*i64"],
             {"BLOCK_SIZE": 16, "HALF": 32, "BT": 64, "BC": 32, "FP16": True}),
            (scatter, ["*fp16", "*fp16", "*bf16", "*i64", "*i64"], {"BLOCK_SIZE": 16, "DIM": 64, "BT": 64})]
