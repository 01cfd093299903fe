"""Triton cache write: scatter the step's new K/V rows into the paged pool, quantizing on the way when 8-bit.

Same contract as reference.write_kv_cache: key/value [T, kv_heads, head_dim] go to slot_mapping [T] (slot =
block * block_size + offset; -1 skips a padding row). int8: symmetric, codes = round(x / s), s = max|x| / 127;
fp8 e4m3fn: codes = x / s, s = max|x| / 448; one float32 scale per token per KV head (see quant.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.kernels import quant

# QUANT flag values (tl.constexpr): how rows are stored.
NONE, INT8, FP8 = 0, 1, 2


def quant_mode(dtype: torch.dtype) -> int:
    if dtype == torch.int8:
        return INT8
    return FP8 if quant.is_quantized(dtype) else NONE


@triton.jit
def _quantize_row(x, QUANT: tl.constexpr, QMAX: tl.constexpr, TINY: tl.constexpr):
    """x [BLOCK_D] float32 (zeros past head_dim) -> (codes as float32, scale)."""
    row_scale = tl.maximum(tl.max(tl.abs(x), axis=0) / QMAX, TINY)
    scaled = x / row_scale
    if QUANT == 1:
        scaled = _round_half_even(scaled)   # as torch.round
    scaled = tl.minimum(tl.maximum(scaled, -QMAX), QMAX)
    if QUANT == 2:
        scaled = _round_to_e4m3(scaled)
    return scaled, row_scale


@triton.jit
def _round_to_e4m3(x):
    """Round float32 x (|x| <= 448) to the nearest e4m3 value, ties to even, in float32 arithmetic, so the cast
    that follows is exact (Triton's interpreter mis-rounds fp8 casts whose mantissa carries into the exponent)."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)                                # e4m3 subnormals: fixed step 2^-9
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)   # 3 mantissa bits
    return _round_half_even(x / step) * step                           # exact: step is a power of two


@triton.jit
def _round_half_even(x):
    low = tl.floor(x)
    frac = x - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), low + 1.0, low)


@triton.jit
def _write_kv_kernel(
    key_ptr,          # [T, kv_heads, head_dim] float16/bfloat16/float32, any strides
    value_ptr,        # [T, kv_heads, head_dim] like key
    k_cache_ptr,      # [num_blocks, BLOCK_SIZE, kv_heads, head_dim] storage dtype
    v_cache_ptr,      # [num_blocks, BLOCK_SIZE, kv_heads, head_dim] same strides as k_cache
    k_scale_ptr,      # [num_blocks, BLOCK_SIZE, kv_heads] float32 (read only when QUANT)
    v_scale_ptr,      # [num_blocks, BLOCK_SIZE, kv_heads] float32, same strides as k_scale
    slot_mapping_ptr, # [T] int32/int64, -1 = skip
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    stride_sb, stride_ss, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr, TINY: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        cache_off = block * stride_cb + offset * stride_cs + head * stride_ch + d
        k = tl.load(key_ptr + token.to(tl.int64) * stride_kt + head * stride_kh + d, mask=dmask).to(tl.float32)
        v = tl.load(value_ptr + token.to(tl.int64) * stride_vt + head * stride_vh + d, mask=dmask).to(tl.float32)
        if QUANT != 0:
            scale_off = block * stride_sb + offset * stride_ss + head * stride_sh
            k, k_s = _quantize_row(k, QUANT, QMAX, TINY)
            v, v_s = _quantize_row(v, QUANT, QMAX, TINY)
            tl.store(k_scale_ptr + scale_off, k_s)
            tl.store(v_scale_ptr + scale_off, v_s)
        tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=dmask)
        tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=dmask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """key/value [T, kv_heads, head_dim] -> their slots in k_cache/v_cache (and k_scale/v_scale when 8-bit)."""
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    mode = quant_mode(k_cache.dtype)
    if (mode != NONE) != (k_scale is not None):
        raise ValueError(f"write_kv_cache: cache dtype {k_cache.dtype} needs scales exactly when it is 8-bit")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("write_kv_cache: k/v caches need equal strides and contiguous head_dim")
    scales = (k_scale, v_scale) if k_scale is not None else (k_cache, v_cache)   # dummies, never read
    scale_strides = k_scale.stride() if k_scale is not None else (0, 0, 0)
    if k_scale is not None and k_scale.stride() != v_scale.stride():
        raise ValueError("write_kv_cache: k_scale and v_scale need equal strides")
    _write_kv_kernel[(num_tokens, kv_heads)](
        key, value, k_cache, v_cache, *scales, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        QUANT=mode, QMAX=quant.INT8_MAX if mode == INT8 else quant.FP8_MAX, TINY=quant.TINY,
    )
