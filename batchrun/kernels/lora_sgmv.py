"""Triton SGMV kernels for LoRA on CUDA (Punica's segmented gather matrix-vector product): the rows of a step are
ordered by adapter, each run of rows under one adapter is a segment, and each segment multiplies by its own
adapter's columns of the stacked weights, in one launch for all adapters. Tested on CPU tensors under
TRITON_INTERPRET=1.

The stacked weights of one projection: a [C, K] (every resident adapter's A, one under the other) and b [N, C]
(their B matrices side by side, scaling folded in); a segment reads columns col .. col + rank of both.
shrink: h[rows] = x[rows] @ a[col:col + rank]^T ([T, R] with R >= every segment's rank, in x's dtype, as PEFT
    runs the product in the adapter's dtype); expand: y[rows] += h[rows, :rank] @ b[:, col:col + rank]^T in place.
Segments are split into tiles of BLOCK_M rows (one program each): `tiles(segments)` builds the table both read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.kernels.dot_precision import dot_precision

BLOCK_M = 16     # rows per tile: tl.dot needs at least 16
BLOCK_R = 16     # rank columns per program (shrink) and per reduction step (expand)
BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, tile_ptr, K, stride_xm, stride_am, stride_hm,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tile_ptr + tl.program_id(0) * 4
    start, end, col, rank = tl.load(tile), tl.load(tile + 1), tl.load(tile + 2), tl.load(tile + 3)
    rm = start + tl.arange(0, BLOCK_M)
    rr = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mmask, rmask = rm < end, rr < rank
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        a = tl.load(a_ptr + (col + rr)[:, None] * stride_am + rk[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)
        acc += tl.dot(x, tl.trans(a), input_precision=DOT_PRECISION)
    tl.store(h_ptr + rm[:, None] * stride_hm + rr[None, :], acc.to(h_ptr.dtype.element_ty),
             mask=mmask[:, None] & rmask[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, tile_ptr, N, stride_hm, stride_bn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tile_ptr + tl.program_id(0) * 4
    start, end, col, rank = tl.load(tile), tl.load(tile + 1), tl.load(tile + 2), tl.load(tile + 3)
    rm = start + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = rm < end, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        rmask = rr < rank
        h = tl.load(h_ptr + rm[:, None] * stride_hm + rr[None, :], mask=mmask[:, None] & rmask[None, :], other=0.0)
        b = tl.load(b_ptr + rn[:, None] * stride_bn + (col + rr)[None, :], mask=nmask[:, None] & rmask[None, :],
                    other=0.0)
        acc += tl.dot(h, tl.trans(b), input_precision=DOT_PRECISION)
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    omask = mmask[:, None] & nmask[None, :]
    tl.store(out, (tl.load(out, mask=omask, other=0.0).to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=omask)


def tiles(segments: list[tuple[int, int, int, int]], device: torch.device | str) -> torch.Tensor:
    """The launch table [tiles, 4] int32 of (first row, end row, first column, rank) for segments given as
    (first row, end row, first column, rank), each cut into BLOCK_M-row tiles."""
    rows = [(s, min(s + BLOCK_M, end), col, rank) for start, end, col, rank in segments
            for s in range(start, end, BLOCK_M)]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device)


def shrink(x: torch.Tensor, a: torch.Tensor, table: torch.Tensor, max_rank: int) -> torch.Tensor:
    """h [T, max_rank] in x's dtype: each tile's rows of x @ its columns of a^T (rows outside every segment and
    columns past a segment's rank are left unset)."""
    _check(x, a, "a", a.shape[1] == x.shape[1])
    h = x.new_empty(x.shape[0], max_rank)
    if len(table):
        grid = (len(table), triton.cdiv(max_rank, BLOCK_R))
        _shrink_kernel[grid](x, a, h, table, x.shape[1], x.stride(0), a.stride(0), h.stride(0), BLOCK_M=BLOCK_M,
                             BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, DOT_PRECISION=dot_precision(x.dtype))
    return h


def expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, table: torch.Tensor) -> None:
    """y[rows] += h[rows, :rank] @ b[:, col:col + rank]^T for each tile, in place."""
    _check(y, b, "b", b.shape[0] == y.shape[1])
    if h.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("lora expand: h and y must have contiguous rows")
    if len(table):
        grid = (len(table), triton.cdiv(y.shape[1], BLOCK_N))
        _expand_kernel[grid](h, b, y, table, y.shape[1], h.stride(0), b.stride(0), y.stride(0), BLOCK_M=BLOCK_M,
                             BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, DOT_PRECISION=dot_precision(h.dtype))


def _check(t: torch.Tensor, w: torch.Tensor, name: str, fits: bool) -> None:
    if t.dim() != 2 or w.dim() != 2 or not fits:
        raise ValueError(f"lora sgmv: {name} {list(w.shape)} does not fit the operand {list(t.shape)}")
    if t.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"lora sgmv: the operand and {name} must have contiguous rows")
    if w.dtype != t.dtype:
        raise ValueError(f"lora sgmv: {name} is {w.dtype}, the operand {t.dtype}")

