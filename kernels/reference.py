"""Pure-torch paged attention: the CPU path of the engine and the reference for the Triton kernels.

Cache layout, per layer: k_cache and v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim],
in the storage dtype; values are converted to the query's dtype on read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter the step's new key/value rows [T, kv_heads, head_dim] to their slots; slot -1 is skipped."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, max_blocks] block tables -> [B, kv_heads, length, head_dim] in `dtype`."""
    batch, num_blocks = block_tables.shape
    num_blocks = min(num_blocks, -(-length // cache.shape[1]))
    blocks = cache[block_tables[:, :num_blocks]]                 # [B, nb, bs, kvh, d]
    rows = blocks.view(batch, -1, *cache.shape[2:])[:, :length]  # [B, L, kvh, d]
    return rows.transpose(1, 2).to(dtype)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per request. query [B, heads, d]; context_lens [B] count the query token itself."""
    max_len = int(context_lens.max())
    keys = gather_kv(k_cache, block_tables, max_len, query.dtype)
    values = gather_kv(v_cache, block_tables, max_len, query.dtype)
    mask = torch.arange(max_len, device=query.device)[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(query[:, :, None], keys, values, attn_mask=mask[:, None, None],
                                         scale=scale, enable_gqa=True)
    return out[:, :, 0]


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """A chunk of one request: query [n, heads, d] holds the last n positions of its `context_len` tokens;
    each attends to the cached prefix and causally within the chunk."""
    n = query.shape[0]
    keys = gather_kv(k_cache, block_table[None], context_len, query.dtype)
    values = gather_kv(v_cache, block_table[None], context_len, query.dtype)
    q_pos = torch.arange(context_len - n, context_len, device=query.device)
    mask = torch.arange(context_len, device=query.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys, values, attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
