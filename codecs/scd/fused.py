"""One Triton kernel for the REUSE decode's dense part on a GPU.

From the unpacked codes to the cache tensors in one pass: gather each group's code rows, multiply
by the folded decoder matrix, add the offset, rotate keys (RoPE, rotate-half form) and write each
head straight into ``[layers, heads, tokens, head_dim]``. The PyTorch path does the same in seven
kernels with three full-size intermediates (float codes, features, the rotation's operands).

Matrix products run in fp16 for half-precision outputs (integer codes are exact in fp16) and in
IEEE fp32 for fp32 outputs. Set ``TRITON_INTERPRET=1`` before import to run it on a CPU (tests).
"""

from __future__ import annotations

import functools
import os

import torch

BLOCK_T = 64
BLOCK_C = 32


@functools.cache
def _kernel():  # noqa: ANN202 - a triton.JITFunction
    import triton
    import triton.language as tl

    @triton.jit
    def decode_kernel(codes, rows, matrix, offset, cos, sin, keys, values, tokens, active, width,
                      s_codes, s_kl, s_kh, s_kt, s_vl, s_vh, s_vt,
                      HALF: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, FP16: tl.constexpr):
        # 64-bit offsets: layer * s_kl (or t * s_kt) passes 2**31 past ~67k tokens of Llama-3-8B's geometry
        group, block = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        head = tl.program_id(2).to(tl.int64)
        t = block * BT + tl.arange(0, BT).to(tl.int64)
        t_ok = t < tokens
        d = tl.arange(0, HALF).to(tl.int64)
        lo_cols = head * 2 * HALF + d
        acc_lo = tl.zeros((BT, HALF), dtype=tl.float32)
        acc_hi = tl.zeros((BT, HALF), dtype=tl.float32)
        for c0 in range(0, active, BC):
            c = c0 + tl.arange(0, BC).to(tl.int64)
            c_ok = c < active
            row = tl.load(rows + group * active + c, mask=c_ok, other=0).to(tl.int64)
            q = tl.load(codes + row[None, :] * s_codes + t[:, None], mask=t_ok[:, None] & c_ok[None, :], other=0)
            m_ptr = matrix + (group * active + c[:, None]) * width + lo_cols[None, :]
            m_lo = tl.load(m_ptr, mask=c_ok[:, None], other=0.0)
            m_hi = tl.load(m_ptr + HALF, mask=c_ok[:, None], other=0.0)
            if FP16:
                qf = q.to(tl.float16)
                acc_lo += tl.dot(qf, m_lo)
                acc_hi += tl.dot(qf, m_hi)
            else:
                qf = q.to(tl.float32)
                acc_lo += tl.dot(qf, m_lo, input_precision="ieee")
                acc_hi += tl.dot(qf, m_hi, input_precision="ieee")
        acc_lo += tl.load(offset + group * width + lo_cols)[None, :]
        acc_hi += tl.load(offset + group * width + lo_cols + HALF)[None, :]
        layer = group // 2
        mask = t_ok[:, None]
        if group % 2 == 0:
            cs = tl.load(cos + t[:, None] * HALF + d[None, :], mask=mask, other=0.0)
            sn = tl.load(sin + t[:, None] * HALF + d[None, :], mask=mask, other=0.0)
            out = keys + layer * s_kl + head * s_kh + t[:, None] * s_kt + d[None, :]
            tl.store(out, (acc_lo * cs - acc_hi * sn).to(keys.dtype.element_ty), mask=mask)
            tl.store(out + HALF, (acc_hi * cs + acc_lo * sn).to(keys.dtype.element_ty), mask=mask)
        else:
            out = values + layer * s_vl + head * s_vh + t[:, None] * s_vt + d[None, :]
            tl.store(out, acc_lo.to(values.dtype.element_ty), mask=mask)
            tl.store(out + HALF, acc_hi.to(values.dtype.element_ty), mask=mask)

    return decode_kernel


@functools.cache
def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: torch.device | str, head_dim: int) -> bool:
    """Whether the fused kernel runs for ``device`` (CUDA with Triton installed, or Triton's
    interpreter) and heads of ``head_dim`` (a power of two from 32: the products' tile sizes)."""
    if head_dim < 32 or head_dim & (head_dim - 1) or not _triton_installed():
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def matrix_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The folded matrix's dtype the kernel reads for an output dtype."""
    return torch.float32 if out_dtype == torch.float32 else torch.float16


def fused_decode(sorted_codes: torch.Tensor, rows: torch.Tensor, matrix: torch.Tensor, offset: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
    """Write the consumer's keys and values ``[L, H, T, D]`` (any strides, unit stride in D).

    ``sorted_codes`` ``[rows, T]`` uint8 (contiguous in T), ``rows`` ``[2L, active]`` int64 (each
    group's component rows), ``matrix`` ``[2L, active, H * D]`` (fp16 or fp32) and ``offset``
    ``[2L, H * D]`` fp32 (the folded decoder, groups K / V interleaved by layer), ``cos`` / ``sin``
    ``[T, D / 2]`` fp32 half tables of the tokens' positions."""
    groups, active = rows.shape
    layers, heads, tokens, head_dim = keys_out.shape
    if groups != 2 * layers or matrix.shape != (groups, active, heads * head_dim) or sorted_codes.stride(1) != 1 \
            or keys_out.stride(3) != 1 or values_out.stride(3) != 1 or sorted_codes.shape[1] != tokens:
        raise ValueError("fused_decode: shapes or strides do not match")
    if not tokens:
        return
    grid = (groups, -(-tokens // BLOCK_T), heads)
    _kernel()[grid](sorted_codes, rows.contiguous(), matrix.contiguous(), offset.contiguous(), cos.contiguous(),
                    sin.contiguous(), keys_out, values_out, tokens, active, heads * head_dim,
                    sorted_codes.stride(0), *keys_out.stride()[:3], *values_out.stride()[:3],
                    HALF=head_dim // 2, BT=BLOCK_T, BC=BLOCK_C, FP16=matrix.dtype == torch.float16)
