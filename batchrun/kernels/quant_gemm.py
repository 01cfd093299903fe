"""Triton dequant-GEMM for quantized weights on CUDA: the weight tile is read in its stored form (int8 codes or
packed 4-bit codes), widened to the activation dtype in registers and multiplied there, so each step reads the
weights' quantized bytes from memory, not a 16-bit copy. Tested on CPU tensors under TRITON_INTERPRET=1.

int8_linear: w [N, K] int8, one float32 scale per output channel; y = (x @ w^T) * scale (+ bias). The codes are
    exact in float16/bfloat16, so the product runs on the codes and the scale multiplies the [M, N] result.
int4_linear: w [N, K // 2] uint8, two codes 0..15 per byte (low nibble = even k, high nibble = odd k), with a scale
    and a zero point per output channel and group of G input channels ([N, K // G] each); the weight is
    (q - zero) * scale, dequantized per element before the product since the scale changes along K.
Both accumulate in float32 and return x's dtype, [M, N].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.kernels.dot_precision import dot_precision

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _int8_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    acc *= tl.load(scale_ptr + rn, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _int4_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_gn,
                 stride_om, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        wmask = nmask[:, None] & kmask[None, :]
        packed = tl.load(w_ptr + rn[:, None] * stride_wn + (rk // 2)[None, :], mask=wmask, other=0).to(tl.int32)
        q = (packed >> ((rk % 2) * 4)[None, :]) & 0xF
        group = rn[:, None] * stride_gn + (rk // GROUP)[None, :]
        scale = tl.load(scale_ptr + group, mask=wmask, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + group, mask=wmask, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - zero) * scale
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def int8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [M, K] float16/bfloat16/float32 @ (w [N, K] int8 * scale [N])^T (+ bias [N]) -> [M, N] in x.dtype."""
    _check(x, w, w.shape[1], torch.int8, "w")
    if scale.shape != (w.shape[0],):
        raise ValueError(f"int8_linear: scale must be [{w.shape[0]}] (one per output channel), "
                         f"got {tuple(scale.shape)}")
    x, out, bias_arg, grid, block_m = _launch_args(x, w.shape[0], bias)
    if x.shape[0]:
        _int8_kernel[grid](x, w, scale.float().contiguous(), bias_arg, out, x.shape[0], w.shape[0], x.shape[1],
                           x.stride(0), w.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m,
                           BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_PRECISION=dot_precision(x.dtype))
    return out


def int4_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ ((q - zeros) * scales)^T (+ bias) -> [M, N] in x.dtype; w [N, K // 2] uint8 holds q (low nibble
    first), scales and zeros are [N, K // group_size]."""
    in_features = w.shape[1] * 2
    _check(x, w, in_features, torch.uint8, "w (two 4-bit codes per byte)")
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"int4_linear: group_size {group_size} does not divide the {in_features} input features")
    groups = (w.shape[0], in_features // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != groups:
            raise ValueError(f"int4_linear: {name} must be {list(groups)} (output channels x groups), "
                             f"got {list(t.shape)}")
    scales, zeros = scales.contiguous(), zeros.to(scales.dtype).contiguous()
    x, out, bias_arg, grid, block_m = _launch_args(x, w.shape[0], bias)
    if x.shape[0]:
        _int4_kernel[grid](x, w, scales, zeros, bias_arg, out, x.shape[0], w.shape[0], in_features, x.stride(0),
                           w.stride(0), scales.stride(0), out.stride(0), GROUP=group_size, HAS_BIAS=bias is not None,
                           BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_PRECISION=dot_precision(x.dtype))
    return out


def _check(x: torch.Tensor, w: torch.Tensor, in_features: int, dtype: torch.dtype, what: str) -> None:
    if w.dtype != dtype or w.dim() != 2:
        raise ValueError(f"quantized linear: {what} must be a 2-D {dtype} tensor, got {w.dtype} {list(w.shape)}")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"quantized linear: x must be [rows, {in_features}], got {list(x.shape)}")
    if w.stride(1) != 1:
        raise ValueError("quantized linear: the weight's rows must be contiguous")


def _launch_args(x: torch.Tensor, out_features: int, bias: torch.Tensor | None):
    x = x if x.stride(1) == 1 else x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    # Decode steps have few rows: a 16-row tile wastes less of the product than a 64-row one.
    block_m = 16 if x.shape[0] <= 16 else 32 if x.shape[0] <= 32 else 64
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(out_features, BLOCK_N))
    return x, out, bias if bias is not None else out, grid, block_m

