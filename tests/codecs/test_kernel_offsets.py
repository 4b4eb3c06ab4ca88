"""64-bit offsets in the Triton kernels (codecs/scd/fused.py, codecs/scd/paged_fused.py): element offsets past
2**31 (a decode of more than ~67k tokens of Llama-3-8B's geometry: layer * layer stride) land where they should.

Each case writes through a view whose stride is just under 2**31 elements (so Triton passes it as a 32-bit
integer) into a storage reaching past 2**31 elements: 4 GiB of address space, of which only the few cells written
are touched (a CPU's untouched pages take no memory). Under Triton's interpreter a 32-bit offset wraps negative
and the kernel writes outside the storage (the process dies); on CUDA the same, plus one real decode past 67k
tokens of Llama-3-8B's geometry."""

from __future__ import annotations

import json
import os
import re
import traceback
from collections.abc import Callable

import pytest
import torch

from scd_store.codecs.scd import fused
from scd_store.codecs.scd import paged_fused as pf
from tests.codecs.triton_runs import interpreter_results, paged_kernels, sm90_compiler

STRIDE = 2**30 + 64  # < 2**31: a 32-bit kernel argument; twice it is past 2**31
T, D, ACT = 64, 32, 32  # tokens, head_dim, active components per group
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def operands(layers: int, heads: int, tokens: int, head_dim: int, device: str, seed: int = 0) -> dict:
    """Exact fused-decode operands: small integer codes, matrix entries in eighths (fp16 products are exact)."""
    g = torch.Generator().manual_seed(seed)
    groups, width = 2 * layers, heads * head_dim
    angle = torch.rand(tokens, head_dim // 2, generator=g) * 6.28
    return {"codes": torch.randint(0, 4, (groups * ACT, tokens), dtype=torch.uint8, generator=g).to(device),
            "rows": torch.randperm(groups * ACT, generator=g).view(groups, ACT).to(device),
            "matrix": (torch.randint(-4, 5, (groups, ACT, width), generator=g) / 8).half().to(device),
            "offset": torch.randn(groups, width, generator=g).to(device),
            "cos": angle.cos().to(device), "sin": angle.sin().to(device)}


def reference(op: dict, group: int, head: int, head_dim: int, tokens: slice = slice(None)) -> torch.Tensor:
    """Group ``group``'s head ``head`` ``[T, D]`` in fp32, rotated for a key group (even), as the kernel computes."""
    q = op["codes"][op["rows"][group]][:, tokens].float()
    acc = q.T @ op["matrix"][group].float() + op["offset"][group]
    half = head_dim // 2
    lo, hi = acc[:, head * head_dim:head * head_dim + half], acc[:, head * head_dim + half:(head + 1) * head_dim]
    if group % 2:
        return torch.cat([lo, hi], 1)
    cs, sn = op["cos"][tokens], op["sin"][tokens]
    return torch.cat([lo * cs - hi * sn, hi * cs + lo * sn], 1)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.allclose(got.float(), want.half().float(), atol=2e-2, rtol=2e-3))


def fused_past_2_31(device: str) -> None:
    """fused_decode into keys / values whose layer stride is STRIDE: layer 2 starts past 2**31 elements."""
    op = operands(3, 1, T, D, device)
    storage = torch.empty(2 * STRIDE + 2 * T * D, dtype=torch.float16, device=device)
    keys = storage.as_strided((3, 1, T, D), (STRIDE, T * D, D, 1))
    values = storage.as_strided((3, 1, T, D), (STRIDE, T * D, D, 1), T * D)
    fused.fused_decode(op["codes"], op["rows"], op["matrix"], op["offset"], op["cos"], op["sin"], keys, values)
    for layer in range(3):
        assert close(keys[layer, 0], reference(op, 2 * layer, 0, D)), f"keys of layer {layer}"
        assert close(values[layer, 0], reference(op, 2 * layer + 1, 0, D)), f"values of layer {layer}"


def paged_heads_past_2_31(device: str) -> None:
    """paged_decode into a heads-outermost cache whose head stride is STRIDE: head 2 starts past 2**31."""
    op = operands(1, 3, T, D, device)
    blocks, block = 4, 16  # T tokens fill the cache: slot t is block t // 16, position t % 16
    storage = torch.empty(2 * STRIDE + blocks * 2 * block * D, dtype=torch.float16, device=device)
    strides = (2 * block * D, block * D, D, STRIDE, 1)  # (block, kv, position, head, dim)
    slots = torch.arange(T, dtype=torch.int64, device=device)
    offsets = torch.zeros(1, dtype=torch.int64, device=device)
    pf.paged_decode(op["codes"], op["rows"], op["matrix"], op["offset"], op["cos"], op["sin"], storage, offsets,
                    strides, block, blocks, slots)
    for head in range(3):
        cells = storage.as_strided((blocks, 2, block, D), strides[:3] + (1,), head * STRIDE)
        for kv in range(2):
            got = cells[:, kv].reshape(T, D)
            assert close(got, reference(op, kv, head, D)), f"head {head}, {'values' if kv else 'keys'}"


def scatter_past_2_31(device: str) -> None:
    """paged_scatter from keys / values whose layer stride is STRIDE: layer 2 is read from past 2**31."""
    g = torch.Generator().manual_seed(3)
    storage = torch.empty(2 * STRIDE + 2 * T * D, dtype=torch.float16, device=device)
    keys = storage.as_strided((3, 1, T, D), (STRIDE, T * D, D, 1))
    values = storage.as_strided((3, 1, T, D), (STRIDE, T * D, D, 1), T * D)
    for layer in range(3):
        keys[layer].copy_(torch.randn(1, T, D, generator=g))
        values[layer].copy_(torch.randn(1, T, D, generator=g))
    blocks, block = 4, 16
    cache = torch.zeros(3, blocks, 2, block, 1, D, dtype=torch.float16, device=device)
    offsets = torch.tensor([i * cache[0].numel() for i in range(3)], dtype=torch.int64, device=device)
    slots = torch.arange(T, dtype=torch.int64, device=device)
    pf.paged_scatter(keys, values, cache, offsets, cache[0].stride(), block, blocks, slots)
    for layer in range(3):
        assert torch.equal(cache[layer, :, 0].reshape(T, D), keys[layer, 0]), f"keys of layer {layer}"
        assert torch.equal(cache[layer, :, 1].reshape(T, D), values[layer, 0]), f"values of layer {layer}"


CASES: dict[str, Callable[[str], None]] = {"fused": fused_past_2_31, "paged": paged_heads_past_2_31,
                                           "scatter": scatter_past_2_31}


def run_interpreter_checks() -> None:
    """Every case under the interpreter (the caller sets TRITON_INTERPRET=1); one JSON line of results (a line
    ``running <case>`` first, so a case that kills the process is named)."""
    results = {}
    for name, case in CASES.items():
        print(f"running {name}", flush=True)
        try:
            case("cpu")
            results[name] = "ok"
        except RuntimeError as exc:
            results[name] = f"skip: {exc}" if "allocate" in str(exc) else traceback.format_exc()[-3000:]
        except Exception:  # noqa: BLE001 - reported per case to the parent test
            results[name] = traceback.format_exc()[-3000:]
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    return interpreter_results("tests.codecs.test_kernel_offsets")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_offsets_past_2_31_under_the_interpreter(interpreted, case):
    if interpreted[case].startswith("skip: "):
        pytest.skip(f"no 4 GiB of address space here: {interpreted[case]}")
    assert interpreted[case] == "ok", interpreted[case]


def test_every_computed_pointer_offset_is_64_bit_in_the_compiled_kernels():
    """Each kernel through Triton's NVIDIA front end (sm_90, no GPU needed) with 32-bit strides, as Triton passes
    strides below 2**31: every ``tt.addptr`` whose offset is 32-bit adds a constant (``+ HALF``), never a product
    of program ids, tokens or rows with a stride."""
    compile_kernel = sm90_compiler()
    for kernel, pointers, constexprs in (
            (fused._kernel(), ["*u8", "*i64", "*fp16", "*fp32", "*fp32", "*fp32", "*fp16", "*fp16"],
             {"HALF": 16, "BT": 64, "BC": 32, "FP16": True}), *paged_kernels()):
        ttir = compile_kernel(kernel, pointers, constexprs, "i32").asm["ttir"]
        adds = re.findall(r"tt\.addptr %[\w.]+, (%[\w.]+) : [^\n]*?(i32|i64)>?\s+loc", ttir)
        assert adds, "no pointer arithmetic found in the TTIR"
        constants = set(re.findall(r"(%[\w.]+) = arith\.constant", ttir))
        narrow = [offset for offset, width in adds if width == "i32" and offset not in constants]
        assert not narrow, f"{kernel.__name__}: 32-bit computed offsets {narrow}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (4 GiB of device memory per case)")
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_offsets_past_2_31_on_cuda(case):
    pytest.importorskip("triton")
    CASES[case]("cuda")
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (about 10 GiB of device memory)")
def test_fused_decode_past_67k_tokens_of_llama3_8b_on_cuda():
    """32 layers x 8 KV heads x 128 dims: layer 31 starts at 31 * 8 * 128 * 68,000 elements, past 2**31."""
    pytest.importorskip("triton")
    layers, heads, dim, tokens = 32, 8, 128, 68_000
    op = operands(layers, heads, tokens, dim, "cuda", seed=1)
    shape = (layers, heads, tokens, dim)
    keys = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
    values = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
    fused.fused_decode(op["codes"], op["rows"], op["matrix"], op["offset"], op["cos"], op["sin"], keys, values)
    torch.cuda.synchronize()
    assert not keys.isnan().any() and not values.isnan().any(), "cells left unwritten"
    for layer in (0, 16, 31):
        for head in (0, heads - 1):
            assert close(keys[layer, head], reference(op, 2 * layer, head, dim)), f"keys {layer}/{head}"
            assert close(values[layer, head], reference(op, 2 * layer + 1, head, dim)), f"values {layer}/{head}"
