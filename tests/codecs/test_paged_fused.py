"""The paged fused decode (codecs/scd/paged_fused.py) against its PyTorch reference: bit for bit against the
fused kernel's decode scattered through the slot table, within the fused tests' tolerance against the plain
PyTorch decode, for fp16 / bf16 / fp32 caches in five strided layouts (views of one allocation, made with
plain torch permutations, no vLLM), block_size 16, tokens from mid-block, slots out of order, some negative
or past the cache (skipped), and every other cell (other blocks, positions, an undecoded layer) untouched.
Under Triton's interpreter on the CPU (one subprocess: the interpreter is chosen at import), on CUDA where
present (with a CUDA-graph capture and replay of the paged launch), and compiled for sm_90 without a GPU."""

from __future__ import annotations

import functools
import json
import traceback
from collections.abc import Callable

import pytest
import torch

from scd_store.codecs.scd import paged_fused as pf
from scd_store.codecs.scd.codec import ScdCodec
from tests.codecs.test_scd_fused import space_and_decoder as fitted_space
from tests.codecs.test_scd_fused import state
from tests.codecs.triton_runs import interpreter_results, paged_kernels, sm90_compiler

BLOCK, BLOCKS, HEADS, DIM, LAYERS = 16, 6, 2, 64, 2
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
Views = Callable[[list[torch.Tensor]], list[torch.Tensor]]
# (allocation shapes, per-layer views of them); every allocation holds one layer more than the codec writes
LAYOUTS: dict[str, tuple[list[tuple[int, ...]], Views]] = {
    # vLLM's [blocks, heads, block_size, 2 * head_dim] views ([K | V] last) of LBNHC / LBHNC / BLNHC caches
    "NHD": ([(LAYERS + 1, BLOCKS, BLOCK, HEADS, 2 * DIM)], lambda b: [b[0][i].transpose(1, 2) for i in range(LAYERS)]),
    "HND": ([(LAYERS + 1, BLOCKS, HEADS, BLOCK, 2 * DIM)], lambda b: [b[0][i] for i in range(LAYERS)]),
    "block-first": ([(BLOCKS, LAYERS + 1, BLOCK, HEADS, 2 * DIM)],
                    lambda b: [b[0][:, i].transpose(1, 2) for i in range(LAYERS)]),
    # logical [blocks, 2, block_size, heads, head_dim] views: K / V outermost; a dim stride of BLOCK
    "kv-first": ([(LAYERS + 1, 2, BLOCKS, BLOCK, HEADS, DIM)],
                 lambda b: [b[0][i].transpose(0, 1) for i in range(LAYERS)]),
    "dim-strided": ([(LAYERS + 1, BLOCKS, HEADS, 2, DIM, BLOCK)],
                    lambda b: [b[0][i].permute(0, 2, 4, 1, 3) for i in range(LAYERS)]),
    # one allocation per layer (a list of tensors with identical strides)
    "separate": ([(BLOCKS, HEADS, BLOCK, 2 * DIM)] * (LAYERS + 1), lambda b: b[:LAYERS]),
}
space_and_decoder = functools.cache(fitted_space)  # one fit (an eigh) per process
# (start, tokens, first offset in the first block, the request's blocks): sinks (positions < 2) in the first
PAYLOADS = ((0, 40, 5, [4, 1, 3]), (37, 45, 9, [5, 2, 0, 3]))


def buffers(layout: str, dtype: torch.dtype, device: str, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype).to(device) for shape in LAYOUTS[layout][0]]


def slots_of(tokens: int, first: int, blocks: list[int], device: str) -> torch.Tensor:
    """The request's slot table shuffled (out of order), with skipped tokens (a sink, others), one past the cache."""
    slots = pf.slot_table(blocks, first, tokens, BLOCK)
    order = torch.randperm(tokens, generator=torch.Generator().manual_seed(tokens))
    slots = slots[order]
    slots[torch.tensor([0, 7, 30])] = -1
    slots[11] = BLOCKS * BLOCK + 3
    return slots.to(device)


def only_slots_changed(before: list[torch.Tensor], after: list[torch.Tensor], views: Views,
                       slots: torch.Tensor) -> bool:
    """Whether ``after`` differs from ``before`` only in the decoded layers' cells at ``slots`` (K and V)."""
    before = [b.clone() for b in before]
    keep = slots[(slots >= 0) & (slots < BLOCKS * BLOCK)]
    blocks, places = keep // BLOCK, keep % BLOCK
    for old, new in zip(pf.paged_caches(views(before)).layers, pf.paged_caches(views(after)).layers, strict=True):
        old[blocks, :, places] = new[blocks, :, places]
    return all(torch.equal(b, a) for b, a in zip(before, after, strict=True))


def read_back(caches: pf.PagedCaches, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens kept, keys, values)``, the caches' keys / values ``[L, H, kept, D]`` at the kept tokens' slots."""
    tokens = ((slots >= 0) & (slots < BLOCKS * BLOCK)).nonzero().squeeze(1)
    blocks, places = slots[tokens] // BLOCK, slots[tokens] % BLOCK
    keys = torch.stack([v[blocks, 0, places].transpose(0, 1) for v in caches.layers])
    values = torch.stack([v[blocks, 1, places].transpose(0, 1) for v in caches.layers])
    return tokens, keys, values


def check_case(layout: str, dtype_name: str, device: str, payload_index: int) -> None:
    """The paged kernel's cells against the fused decode scattered (bit for bit) and the PyTorch decode."""
    space, decoder = space_and_decoder()
    dtype, views = DTYPES[dtype_name], LAYOUTS[layout][1]
    paged = ScdCodec(space, decoder, cuda_graphs=False, fused_kernel=True)
    plain = ScdCodec(space, decoder, cuda_graphs=False, fused_kernel=False, matmul="float32")
    start, tokens, first, blocks = PAYLOADS[payload_index]
    payload = paged.encode(state(tokens, start, seed=start))
    codes = space.unpack(payload, device)
    slots = slots_of(tokens, first, blocks, device)
    before = buffers(layout, dtype, device)
    got, want = [b.clone() for b in before], [b.clone() for b in before]
    assert pf.decode_paged(paged, codes, pf.paged_caches(views(got)), slots), "the paged kernel did not run"
    pf.decode_paged_eager(paged, codes, pf.paged_caches(views(want)), slots)  # the fused kernel's decode, scattered
    kept, keys, values = read_back(pf.paged_caches(views(got)), slots)
    _, want_keys, want_values = read_back(pf.paged_caches(views(want)), slots)
    coded = kept >= (codes.sinks.num_tokens if codes.sinks is not None else 0)
    assert torch.equal(keys[:, :, coded], want_keys[:, :, coded]), "keys differ from the fused decode scattered"
    assert torch.equal(values[:, :, coded], want_values[:, :, coded]), "values differ from the fused decode scattered"
    if device == "cpu" and dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 (the GPU rounds)
        torch.testing.assert_close(keys.float(), want_keys.float(), atol=0, rtol=2 ** -7)
    else:  # the raw sink tokens too: every cell, bit for bit
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), "differs from the reference"
    assert only_slots_changed(before, got, views, slots), "cells outside the slot table changed"
    reference = plain.decode_codes(codes, device, torch.float32)
    assert kept.numel() == tokens - 4
    want_k, want_v = reference.keys[:, :, kept], reference.values[:, :, kept]
    if dtype == torch.float32:
        torch.testing.assert_close(keys, want_k, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(values, want_v, atol=2e-4, rtol=2e-4)
    else:
        assert float((keys.float() - want_k).abs().max() / want_k.abs().max()) < 1e-2
        assert float((values.float() - want_v).abs().max() / want_v.abs().max()) < 1e-2


# every dtype in vLLM's three layouts, one in each other; the two payloads (with and without sinks) alternating
CASES = [(lay, name, i % 2) for i, (lay, name) in enumerate(
    [(lay, n) for lay in ("NHD", "HND", "block-first") for n in DTYPES]
    + [("kv-first", "fp16"), ("dim-strided", "bf16"), ("separate", "fp32"), ("separate", "bf16")])]


def case_id(case: tuple[str, str, int]) -> str:
    return f"{case[0]}-{case[1]}-p{case[2]}"


def run_interpreter_checks() -> None:
    """Every case under the interpreter (the caller sets TRITON_INTERPRET=1); prints one JSON line of results."""
    results = {}
    for case in CASES:
        try:
            check_case(*case[:2], "cpu", case[2])
            results[case_id(case)] = "ok"
        except Exception:  # noqa: BLE001 - reported per case to the parent test
            results[case_id(case)] = traceback.format_exc()[-3000:]
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    return interpreter_results("tests.codecs.test_paged_fused")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_paged_kernel_matches_the_reference_under_the_interpreter(interpreted, case):
    assert interpreted[case_id(case)] == "ok", interpreted[case_id(case)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_paged_kernel_matches_the_reference_on_cuda(case):
    pytest.importorskip("triton")
    check_case(*case[:2], "cuda", case[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_a_captured_paged_launch_replays_into_the_same_cells(dtype_name):
    pytest.importorskip("triton")
    space, decoder = space_and_decoder()
    codec = ScdCodec(space, decoder, cuda_graphs=False, fused_kernel=True)
    start, tokens, first, blocks = PAYLOADS[0]
    codes = space.unpack(codec.encode(state(tokens, start, seed=start)), "cuda")
    sinks = codes.sinks.num_tokens
    angles = codec.angles(start + sinks, tokens - sinks, "cuda")
    views = LAYOUTS["block-first"][1]
    before = buffers("block-first", DTYPES[dtype_name], "cuda")
    got, want = [b.clone() for b in before], [b.clone() for b in before]
    caches, slots = pf.paged_caches(views(got)), slots_of(tokens, first, blocks, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: builds the kernels, folds the matrices
        assert pf.decode_paged(codec, codes, caches, slots, angles)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert pf.decode_paged(codec, codes, caches, slots, angles)
    for g, b in zip(got, before, strict=True):
        g.copy_(b)
    graph.replay()
    torch.cuda.synchronize()
    pf.decode_paged_eager(codec, codes, pf.paged_caches(views(want)), slots, angles)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    moved = slots_of(tokens, first, [b + 1 if b < BLOCKS - 1 else 0 for b in blocks], "cuda")
    for g, b in zip(got, before, strict=True):
        g.copy_(b)
    slots.copy_(moved)  # the replay reads the slot table as it is then
    graph.replay()
    torch.cuda.synchronize()
    want = [b.clone() for b in before]
    pf.decode_paged_eager(codec, codes, pf.paged_caches(views(want)), moved, angles)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_paged_kernels_compile_for_a_gpu_without_one():
    """Both kernels through Triton's whole NVIDIA pipeline to a cubin (sm_90), which the interpreter skips."""
    compile_kernel = sm90_compiler()
    for kernel, pointers, constexprs in paged_kernels():
        compiled = compile_kernel(kernel, pointers, constexprs, "i64")
        assert compiled.asm["cubin"]
