"""Attention backend on the Triton kernels (batchrun/kernels/cache_write.py, paged_attention.py): the CUDA path.

Per step it needs, beyond AttentionMetadata, one padded block table for all decodes and one for all prefill
chunks (plus cu_seqlens and context lengths). It builds them from the decode groups and prefill chunks once per
step (the first layer's call) and reuses them for the other layers.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from batchrun.attention_metadata import AttentionMetadata
from batchrun.engine import row_attention
from batchrun.engine.kv_cache import LayerCache


class TritonStepTensors(NamedTuple):
    decode_tables: torch.Tensor | None     # [num_decodes, max_blocks]
    decode_lens: torch.Tensor | None       # [num_decodes], the new token included
    decode_max_len: int
    prefill_tables: torch.Tensor | None    # [R, max_blocks]
    query_start: torch.Tensor | None       # [R + 1] int32, cu_seqlens in the step's token dimension
    prefill_lens: torch.Tensor | None      # [R] int32, the chunk included
    max_query_len: int


def _stack_padded(tables: list[torch.Tensor]) -> torch.Tensor:
    """Block tables [n_i, w_i] (or [w_i]) -> [sum n_i, max w_i], padded with block 0 (never read)."""
    tables = [t if t.dim() == 2 else t[None] for t in tables]
    width = max(t.shape[1] for t in tables)
    return torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables])


def build_step_tensors(meta: AttentionMetadata, device: torch.device) -> TritonStepTensors:
    decode_tables = decode_lens = prefill_tables = query_start = prefill_lens = None
    decode_max_len = max_query_len = 0
    if meta.decode_groups:
        if any(g.start != end for g, end in zip(meta.decode_groups, [0] + [g.end for g in meta.decode_groups])):
            raise ValueError("TritonAttentionBackend: decode groups must cover the first rows, back to back")
        decode_tables = _stack_padded([g.block_tables for g in meta.decode_groups])
        decode_lens = torch.cat([g.context_lens for g in meta.decode_groups])
        decode_max_len = max(g.max_len for g in meta.decode_groups)
    if meta.prefills:
        prefill_tables = _stack_padded([c.block_table for c in meta.prefills])
        starts = [c.query_start for c in meta.prefills] + [meta.prefills[-1].query_start + meta.prefills[-1].query_len]
        if any(c.query_start + c.query_len != nxt for c, nxt in zip(meta.prefills, starts[1:])):
            # chunks not back to back: give each its own row range through explicit starts and ends
            raise ValueError("TritonAttentionBackend: prefill chunks must be consecutive in the token dimension")
        query_start = torch.tensor(starts, dtype=torch.int32, device=device)
        prefill_lens = torch.tensor([c.context_len for c in meta.prefills], dtype=torch.int32, device=device)
        max_query_len = max(c.query_len for c in meta.prefills)
    return TritonStepTensors(decode_tables, decode_lens, decode_max_len, prefill_tables, query_start, prefill_lens,
                             max_query_len)


class TritonAttentionBackend:
    """Cache write, one decode launch for all decode requests, one varlen launch for all prefill chunks."""

    name = "triton"
    pads_decodes = False   # takes every decode request in one padded table
    reads_shared_prefixes = False

    def __init__(self, device: torch.device, deterministic: bool = False):
        self.deterministic = deterministic   # every row a decode of its own, fixed KV splits (row_attention.py)
        try:
            import triton
            from batchrun.kernels import cache_write, paged_attention
        except ImportError as e:
            raise ValueError(f"attention_backend: 'triton' needs the triton package ({e}); use 'torch'") from e
        if device.type != "cuda" and not triton.knobs.runtime.interpret:
            raise ValueError(f"attention_backend: 'triton' runs on CUDA, not on {device.type}; use 'torch' or "
                             "'auto' there (TRITON_INTERPRET=1 runs the kernels on CPU, slowly, for tests)")
        self._cache_write, self._attention = cache_write, paged_attention

    @staticmethod
    def _step_tensors(meta: AttentionMetadata, device: torch.device) -> TritonStepTensors:
        """Built once per step and lane segment, then reused by every layer."""
        if meta.triton_step is None:
            meta.triton_step = build_step_tensors(meta, device)
        return meta.triton_step

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: LayerCache,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """query [T, heads, d], key/value [T, kv_heads, d] -> [T, heads, d]; `window` W: each query sees its
        last W positions; `softcap` c: scores become c * tanh(scores / c)."""
        k, v, k_scale, v_scale = cache
        self._cache_write.write_kv_cache(key, value, k, v, meta.slot_mapping, k_scale, v_scale)
        if self.deterministic:
            rows = row_attention.row_tables(meta, query.shape[0], query.device)
            return self._attention.paged_decode_attention(
                query, k, v, rows.block_tables, rows.context_lens, scale, k_scale, v_scale, max_len=rows.max_len,
                split_len=self._attention.DETERMINISTIC_SPLIT_LEN, window=window, softcap=softcap)
        step = self._step_tensors(meta, query.device)
        out = torch.empty_like(query)
        if step.decode_tables is not None:
            rows = slice(0, step.decode_tables.shape[0])
            self._attention.paged_decode_attention(query[rows], k, v, step.decode_tables, step.decode_lens, scale,
                                                   k_scale, v_scale, max_len=step.decode_max_len, out=out[rows],
                                                   window=window, softcap=softcap)
        if step.prefill_tables is not None:
            self._attention.paged_prefill_attention(query, k, v, step.prefill_tables, step.query_start,
                                                    step.prefill_lens, scale, k_scale, v_scale,
                                                    max_query_len=step.max_query_len, out=out, window=window,
                                                    softcap=softcap)
        return out
