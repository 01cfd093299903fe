"""Triton paged attention: decode (one query token per request, optionally split over the KV length and reduced)
and varlen prefill (chunks of many requests in one launch, attending to each request's cached prefix and
causally within the chunk). K/V are read through block tables and dequantized in the kernel.

Cache layout as in reference.py: k/v [num_blocks, block_size, kv_heads, head_dim] (16/32-bit, or int8 / fp8 e4m3fn
codes with k_scale/v_scale [num_blocks, block_size, kv_heads] float32). Quantized codes are exact in float16, so
the kernels multiply codes, not dequantized values: scores by the key's scale, probabilities by the value's scale.
Softmax is online, in float32, in base 2 (scores pre-multiplied by scale * log2(e)).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.kernels.cache_write import NONE, quant_mode
from batchrun.kernels.dot_precision import dot_precision

LOG2E = 1.4426950408889634
SPLIT_MIN_TOKENS = 512      # a split-KV program gets at least this many tokens
# Deterministic mode: every decode splits its KV at multiples of this many tokens whatever the batch and the longest
# context, and is always reduced by the split kernel, so a row's summation order depends only on its own length.
DETERMINISTIC_SPLIT_LEN = 512
NO_WINDOW = 2**30           # the window argument of full attention (a run-time value: no recompile per window)


@triton.jit
def _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_row_ptr, n, valid,
                 kv_head, d, dmask, qk_scale, softcap, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                 stride_sh, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """One online-softmax step over keys n [BLOCK_N] of one request; valid [M, BLOCK_N] masks scores.
    q [M, BLOCK_D] (compute dtype), m/l [M] and acc [M, BLOCK_D] float32. SOFTCAP: scaled scores x become
    softcap * tanh(x / softcap)."""
    nmask = tl.max(valid.to(tl.int32), axis=0) > 0
    block = tl.load(block_row_ptr + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    offset = n % BLOCK_SIZE
    rows = block * stride_cb + offset * stride_cs + kv_head * stride_ch
    kv_mask = nmask[:, None] & dmask[None, :]
    # No `other=`: fp8 loads take none in the interpreter; masked lanes are zeroed after the conversion.
    k = tl.where(kv_mask, tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask).to(q.dtype), 0.0)
    v = tl.where(kv_mask, tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask).to(q.dtype), 0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)                      # [M, BLOCK_N] float32
    if QUANT != 0:
        scale_rows = block * stride_sb + offset * stride_ss + kv_head * stride_sh
        k_s = tl.load(k_scale_ptr + scale_rows, mask=nmask, other=0.0)
        v_s = tl.load(v_scale_ptr + scale_rows, mask=nmask, other=0.0)
        s = s * (k_s * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if SOFTCAP:   # s is x * log2(e); tanh(y) = 1 - 2 / (exp(2y) + 1), which saturates cleanly at +-1
        y = s / (LOG2E * softcap)
        s = (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * (softcap * LOG2E)
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # A row with no valid key yet (a sliding window starting past this tile) keeps m = -inf: subtract 0 there,
    # not -inf, so its p and alpha are 0 rather than NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, axis=1)
    if QUANT != 0:
        p = p * v_s[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _decode_kernel(
    out_ptr,          # SPLIT: [B, heads, NUM_SPLITS, head_dim] float32, unnormalised; else [B, heads, head_dim]
    m_ptr,            # SPLIT: [B, heads, NUM_SPLITS] float32 running max (base 2); unused otherwise
    l_ptr,            # SPLIT: [B, heads, NUM_SPLITS] float32 softmax denominator; unused otherwise
    q_ptr,            # [B, heads, head_dim] float16/bfloat16/float32, head_dim contiguous
    k_cache_ptr,      # [num_blocks, BLOCK_SIZE, kv_heads, head_dim] storage dtype
    v_cache_ptr,      # [num_blocks, BLOCK_SIZE, kv_heads, head_dim] same strides as k_cache
    k_scale_ptr,      # [num_blocks, BLOCK_SIZE, kv_heads] float32 (read only when QUANT)
    v_scale_ptr,      # [num_blocks, BLOCK_SIZE, kv_heads] float32, same strides as k_scale
    block_tables_ptr, # [B, max_blocks] int32/int64
    context_lens_ptr, # [B] int32/int64, the query token included
    qk_scale,         # softmax scale * log2(e)
    split_len,        # tokens per split, a multiple of BLOCK_N
    window,           # sliding window W: keys at positions >= context_len - W (2**30: all)
    softcap,          # attention logit soft-cap (read only when SOFTCAP)
    stride_qb, stride_qh, stride_ob, stride_oh, stride_os,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Program (request b, KV head, split): all GROUP query heads of the KV head against keys of the split."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + b)
    lo = split * split_len
    hi = tl.minimum(context_len, lo + split_len)
    first = tl.maximum(context_len - window, 0)   # the oldest position inside the window
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    dmask = d < HEAD_DIM
    qmask = (g < GROUP)[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(tl.maximum(lo, first // BLOCK_N * BLOCK_N), hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = tl.broadcast_to(((n < hi) & (n >= first))[None, :], [GROUP_PAD, BLOCK_N])
        m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                 block_tables_ptr + b * stride_bt, n, valid, kv_head, d, dmask, qk_scale, softcap,
                                 stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                                 BLOCK_SIZE, QUANT, DOT_PRECISION, SOFTCAP)
    if SPLIT:
        out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(out, acc, mask=qmask)
        stats = (b * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split   # [B, heads, NUM_SPLITS]
        tl.store(m_ptr + stats, m, mask=g < GROUP)
        tl.store(l_ptr + stats, l, mask=g < GROUP)
    else:
        out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,          # [B, heads, head_dim] query dtype
    partial_ptr,      # [B, heads, NUM_SPLITS, head_dim] float32, contiguous
    m_ptr,            # [B, heads, NUM_SPLITS] float32, contiguous
    l_ptr,            # [B, heads, NUM_SPLITS] float32, contiguous
    stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (request b, head): combine the splits' partial results; empty splits have m = -inf, l = 0."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = b * tl.num_programs(1) + head
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    smask = s < NUM_SPLITS
    m = tl.load(m_ptr + row * NUM_SPLITS + s, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + row * NUM_SPLITS + s, mask=smask, other=0.0)
    weight = tl.where(smask, tl.math.exp2(m - tl.max(m, axis=0)), 0.0)   # the last split is never empty
    mask = smask[:, None] & (d < HEAD_DIM)[None, :]
    partial = tl.load(partial_ptr + (row * NUM_SPLITS + s[:, None]) * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    out = tl.sum(partial * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    out_ptr,          # [T, heads, head_dim] query dtype
    q_ptr,            # [T, heads, head_dim] float16/bfloat16/float32, head_dim contiguous
    k_cache_ptr,      # [num_blocks, BLOCK_SIZE, kv_heads, head_dim] storage dtype
    v_cache_ptr,      # [num_blocks, BLOCK_SIZE, kv_heads, head_dim] same strides as k_cache
    k_scale_ptr,      # [num_blocks, BLOCK_SIZE, kv_heads] float32 (read only when QUANT)
    v_scale_ptr,      # [num_blocks, BLOCK_SIZE, kv_heads] float32, same strides as k_scale
    block_tables_ptr, # [R, max_blocks] int32/int64, one row per chunk's request
    query_start_ptr,  # [R + 1] int32/int64: chunk r is query rows [query_start[r], query_start[r + 1])
    context_lens_ptr, # [R] int32/int64: request's tokens in the cache after this step, the chunk included
    qk_scale,         # softmax scale * log2(e)
    window,           # sliding window W: row at position p sees keys p - W < n <= p (2**30: all)
    softcap,          # attention logit soft-cap (read only when SOFTCAP)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Program (chunk r, query tile, head): BLOCK_M query rows of the chunk against the request's keys up to
    each row's position (the cached prefix and causally within the chunk)."""
    r = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + r).to(tl.int64)
    q_len = tl.load(query_start_ptr + r + 1).to(tl.int64) - q_start
    if tile * BLOCK_M < q_len:
        context_len = tl.load(context_lens_ptr + r)
        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pos = context_len - q_len + i                     # position of each query row in its request
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        qmask = (i < q_len)[:, None] & dmask[None, :]
        q = tl.load(q_ptr + (q_start + i)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=qmask, other=0.0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = tl.minimum(context_len, context_len - q_len + (tile + 1) * BLOCK_M)
        lo = tl.maximum(context_len - q_len + tile * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = (n[None, :] <= pos[:, None]) & (n[None, :] > pos[:, None] - window) & (n < context_len)[None, :]
            m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                     block_tables_ptr + r * stride_bt, n, valid, head // GROUP, d, dmask, qk_scale,
                                     softcap, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                                     BLOCK_SIZE, QUANT, DOT_PRECISION, SOFTCAP)
        out = out_ptr + (q_start + i)[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(out, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)


def _check_cache(query, k_cache, v_cache, k_scale, v_scale) -> int:
    """Validate the layouts the kernels assume; returns the QUANT flag."""
    mode = quant_mode(k_cache.dtype)
    if (mode != NONE) != (k_scale is not None and v_scale is not None):
        raise ValueError(f"paged attention: cache dtype {k_cache.dtype} needs k_scale/v_scale exactly when 8-bit")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("paged attention: k/v caches need equal strides; caches and query a contiguous head_dim")
    if k_scale is not None and k_scale.stride() != v_scale.stride():
        raise ValueError("paged attention: k_scale and v_scale need equal strides")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"paged attention: {query.shape[1]} query heads are not a multiple of "
                         f"{k_cache.shape[2]} KV heads")
    return mode


def _common(query, k_cache, k_scale, scale):
    """Arguments shared by both kernels: (scale tensors' strides, dot precision, qk scale in base 2)."""
    scale_strides = k_scale.stride() if k_scale is not None else (0, 0, 0)
    return (*k_cache.stride()[:3], *scale_strides), dot_precision(query.dtype), scale * LOG2E


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, kv_heads: int, max_len: int, num_sms: int) -> int:
    """Split the KV length only when the (request, KV head) programs cannot fill the SMs twice over; a power of
    two, each split at least SPLIT_MIN_TOKENS long."""
    programs = batch * kv_heads
    if programs >= 2 * num_sms or max_len < 2 * SPLIT_MIN_TOKENS:
        return 1
    wanted = min(-(-2 * num_sms // programs), max_len // SPLIT_MIN_TOKENS)
    return 1 << (max(wanted, 1).bit_length() - 1)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           max_len: int | None = None, num_splits: int | None = None, out: torch.Tensor | None = None,
                           block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                           window: int | None = None, softcap: float | None = None,
                           split_len: int | None = None) -> torch.Tensor:
    """query [B, heads, d]; block_tables [B, max_blocks]; context_lens [B], the query token included -> [B, heads, d].
    num_splits None: chosen from the batch and max_len (max_len None reads context_lens, a device sync).
    window W: only the last W positions are attended to; softcap c: scores become c * tanh(scores / c).
    split_len (a multiple of block_n): the KV splits at fixed multiples of it, always reduced by the split kernel
    (deterministic mode: a row's result does not depend on the batch or its longest context)."""
    mode = _check_cache(query, k_cache, v_cache, k_scale, v_scale)
    batch, heads, head_dim = query.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(query) if out is None else out
    if batch == 0:
        return out
    block_n = block_n or (max(64, block_size) if query.is_cuda else max(16, block_size))
    if split_len is not None:
        if split_len % block_n:
            raise ValueError(f"paged attention: split_len {split_len} is not a multiple of block_n {block_n}")
        max_len = max_len if max_len is not None else int(context_lens.max())
        num_splits = -(-max_len // split_len)
    elif num_splits is None:
        max_len = max_len if max_len is not None else int(context_lens.max())
        num_splits = choose_num_splits(batch, kv_heads, max_len, _num_sms(query.device))
    group = heads // kv_heads
    cache_strides, precision, qk_scale = _common(query, k_cache, k_scale, scale)
    scales = (k_scale, v_scale) if k_scale is not None else (k_cache, v_cache)   # dummies, never read
    meta = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_N=block_n,
                QUANT=mode, DOT_PRECISION=precision, SOFTCAP=softcap is not None, num_warps=num_warps,
                num_stages=num_stages)
    grid = (batch, kv_heads, num_splits)
    if num_splits == 1 and split_len is None:
        _decode_kernel[grid](out, out, out, query, k_cache, v_cache, *scales, block_tables, context_lens, qk_scale,
                             2**30, window or NO_WINDOW, softcap or 0.0, query.stride(0), query.stride(1), out.stride(0),
                             out.stride(1), 0,
                             *cache_strides, block_tables.stride(0), SPLIT=False, **meta)
        return out
    if max_len is None:
        max_len = int(context_lens.max())
    split_len = split_len or -(-max_len // (num_splits * block_n)) * block_n
    partial = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    m = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    _decode_kernel[grid](partial, m, l, query, k_cache, v_cache, *scales, block_tables, context_lens, qk_scale,
                         split_len, window or NO_WINDOW, softcap or 0.0, query.stride(0), query.stride(1), *partial.stride()[:3],
                         *cache_strides, block_tables.stride(0), SPLIT=True, **meta)
    _reduce_splits_kernel[(batch, heads)](out, partial, m, l, out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
                                          SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
                                          BLOCK_D=meta["BLOCK_D"])
    return out


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            max_query_len: int | None = None, out: torch.Tensor | None = None,
                            block_m: int | None = None, block_n: int | None = None, num_warps: int = 4,
                            num_stages: int = 2, window: int | None = None, softcap: float | None = None
                            ) -> torch.Tensor:
    """Varlen prefill / mixed batch in one launch. query [T, heads, d]; chunk r is rows query_start[r] to
    query_start[r + 1] (query_start [R + 1], cu_seqlens), the last rows of its request's context_lens[r] tokens;
    block_tables [R, max_blocks]. Rows outside every chunk are left as they are in `out` (default: empty).
    window W: a row at position p sees keys p - W < n <= p; softcap c: scores become c * tanh(scores / c)."""
    mode = _check_cache(query, k_cache, v_cache, k_scale, v_scale)
    num_chunks = block_tables.shape[0]
    heads, head_dim = query.shape[1:]
    out = torch.empty_like(query) if out is None else out
    if num_chunks == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start[1:] - query_start[:-1]).max())
    block_m = block_m or (64 if query.is_cuda else 16)
    block_n = block_n or (64 if query.is_cuda else max(16, k_cache.shape[1]))
    cache_strides, precision, qk_scale = _common(query, k_cache, k_scale, scale)
    scales = (k_scale, v_scale) if k_scale is not None else (k_cache, v_cache)
    grid = (num_chunks, triton.cdiv(max_query_len, block_m), heads)
    _prefill_kernel[grid](out, query, k_cache, v_cache, *scales, block_tables, query_start, context_lens, qk_scale,
                          window or NO_WINDOW, softcap or 0.0, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                          *cache_strides,
                          block_tables.stride(0), GROUP=heads // k_cache.shape[2], HEAD_DIM=head_dim,
                          BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=k_cache.shape[1],
                          BLOCK_M=block_m, BLOCK_N=block_n, QUANT=mode, DOT_PRECISION=precision,
                          SOFTCAP=softcap is not None,
                          num_warps=num_warps, num_stages=num_stages)
    return out
