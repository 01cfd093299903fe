"""Pure-torch paged attention: the CPU path of the engine and the reference for the Triton kernels.

Cache layout, per layer: k_cache and v_cache [num_blocks, block_size, kv_heads, head_dim] in the storage dtype
(float32/float16/bfloat16, or int8/fp8 codes with k_scale/v_scale [num_blocks, block_size, kv_heads] float32).
Values are dequantized / converted to the query's dtype on read.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from batchrun.kernels import quant


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 (CPU torch lacks indexing kernels for float8); other dtypes unchanged."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype != torch.int8 else t


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Scatter the step's new key/value rows [T, kv_heads, head_dim] to their slots (quantizing when the cache
    has scales); slot -1 is skipped."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    for rows, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if scales is not None:
            rows, row_scales = quant.quantize(rows, cache.dtype)
            scales.view(-1, scales.shape[-1]).index_copy_(0, slot_mapping, row_scales)
        _as_bits(cache).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, _as_bits(rows.to(cache.dtype)))


class Workspace:
    """Scratch memory reused across layers and steps for gathered K/V. A fresh allocation of tens of MB is
    mapped anew by the C allocator each time and page-faults on first touch: about 4x slower than the copy."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get((name, dtype, device))
        if buf is None or buf.numel() < numel:
            buf = self._buffers[(name, dtype, device)] = torch.empty(numel + numel // 4, dtype=dtype, device=device)
        return buf[:numel].view(shape)


def _gather_rows(cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor, length: int,
                 dtype: torch.dtype, workspace: Workspace | None = None, name: str = "") -> torch.Tensor:
    """[B, max_blocks] block tables -> [B, length, kv_heads, head_dim] in `dtype`, dequantized."""
    batch = block_tables.shape[0]
    num_blocks = min(block_tables.shape[1], -(-length // cache.shape[1]))
    tables = block_tables[:, :num_blocks].reshape(-1)
    bits = _as_bits(cache)
    flat = bits.view(bits.shape[0], -1)
    out = None if workspace is None else workspace.get(name, (tables.numel(), flat.shape[1]), flat.dtype,
                                                       flat.device)
    rows = torch.index_select(flat, 0, tables, out=out).view(cache.dtype)
    rows = rows.view(batch, -1, *cache.shape[2:])[:, :length]
    if scales is None and rows.dtype == dtype:
        return rows
    converted = (torch.empty(rows.shape, dtype=dtype, device=rows.device) if workspace is None
                 else workspace.get(name + ".float", tuple(rows.shape), dtype, rows.device))
    converted.copy_(rows)
    if scales is not None:
        converted.mul_(scales[tables].view(batch, -1, scales.shape[-1])[:, :length, :, None])
    return converted


def gather_kv(cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor, length: int,
              dtype: torch.dtype) -> torch.Tensor:
    """[B, max_blocks] block tables -> [B, kv_heads, length, head_dim] in `dtype`, dequantized."""
    return _gather_rows(cache, scales, block_tables, length, dtype).transpose(1, 2)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           max_len: int | None = None, workspace: Workspace | None = None,
                           window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One query token per request. query [B, heads, d]; context_lens [B] count the query token itself. `window`
    W: only the last W positions are seen; `softcap` c: scores become c * tanh(scores / c)."""
    batch, heads, dim = query.shape
    max_len = max_len or int(context_lens.max())
    # Gathered rows stay [B, L, kv_heads, d]; each KV head's keys are a strided [B, L, d] view that batched
    # matrix products read without another copy.
    keys = _gather_rows(k_cache, k_scale, block_tables, max_len, query.dtype, workspace, "k")
    values = _gather_rows(v_cache, v_scale, block_tables, max_len, query.dtype, workspace, "v")
    kv_heads = keys.shape[2]
    q = query.view(batch, kv_heads, heads // kv_heads, dim) * scale
    pos = torch.arange(max_len, device=query.device)[None, None, :]
    pad = pos >= context_lens[:, None, None]
    if window is not None:
        pad |= pos <= context_lens[:, None, None] - 1 - window
    out = torch.empty_like(q)
    for h in range(kv_heads):
        scores = _softcap(torch.bmm(q[:, h], keys[:, :, h].transpose(1, 2)), softcap).masked_fill_(pad, float("-inf"))
        torch.bmm(torch.softmax(scores, dim=-1), values[:, :, h], out=out[:, h])
    return out.view(batch, heads, dim)


def _softcap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
               window: int | None, softcap: float | None) -> torch.Tensor:
    """q [1, heads, n, d] at positions q_pos [n]; k/v [1, kv_heads, L, d] at positions 0..L-1; causal, within the
    window when given. SDPA where it can (no softcap), else explicit scores."""
    keys = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = keys <= q_pos[:, None]
    if window is not None:
        mask &= keys > q_pos[:, None] - window
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = _softcap(q @ k.transpose(-1, -2) * scale, softcap).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


_PAD_MIN_CHUNK = 256


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """A chunk of one request: query [n, heads, d] holds the last n positions of its `context_len` tokens;
    each attends to the cached prefix and causally within the chunk (within the last `window` positions)."""
    n = query.shape[0]
    keys = gather_kv(k_cache, k_scale, block_table[None], context_len, query.dtype)
    values = gather_kv(v_cache, v_scale, block_table[None], context_len, query.dtype)
    q = query.transpose(0, 1)[None]
    prefix = context_len - n
    if window is None and softcap is None and (prefix == 0 or (n >= _PAD_MIN_CHUNK and 2 * prefix <= n)):
        # Plain causal attention skips the masked half, which SDPA with a mask cannot. After a short cached prefix
        # it is still cheaper over zero queries for the prefix positions (their rows dropped): SmolLM2's heads,
        # bfloat16, one thread of an Intel Xeon, 868 new of 900 tokens 9.4 -> 5.4 ms, 522 of 554 3.5 -> 2.3 ms,
        # 1000 of 1500 16.0 -> 12.2 ms; at 256 new tokens or a prefix over half the chunk it gained nothing or lost.
        if prefix:
            q = torch.cat([q.new_zeros(*q.shape[:2], prefix, q.shape[3]), q], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        out = out[:, :, prefix:]
    else:
        q_pos = torch.arange(context_len - n, context_len, device=query.device)
        out = _attention(q, keys, values, q_pos, scale, window, softcap)
    return out[0].transpose(0, 1)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """A whole prompt attending to itself: query [n, heads, d], key/value [n, kv_heads, d] -> [n, heads, d]."""
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
    if window is None and softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = _attention(q, k, v, torch.arange(query.shape[0], device=query.device), scale, window, softcap)
    return out[0].transpose(0, 1)
