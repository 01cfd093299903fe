"""The CPU attention backend: reads and writes the paged KV cache (the Triton one is in triton_backend.py)."""
from __future__ import annotations

import torch

from batchrun.attention_metadata import AttentionMetadata, DecodeGroup
from batchrun.engine import row_attention
from batchrun.engine.kv_cache import LayerCache
from batchrun.kernels import cpu_attention, reference


class TorchAttentionBackend:
    """Decodes: on CPU the compiled kernel (batchrun/kernels/cpu_attention.py) over all decode requests at once, reading the
    paged pool in place; without it, the pure-torch path vectorised over groups of similar context length (so
    padding stays small); decode requests that share a cached prefix (engine/shared_prefix.py) read it once, all
    together, where the prefill kernel below runs. Prefill chunks one request at a time (few per step): with a
    bfloat16 cache on a CPU with AVX512-BF16 (or AMX), or a float32 one on AVX-512, the kernel's flash attention over
    the paged blocks; otherwise torch's SDPA (over the fresh K/V, or a gathered copy after a cached prefix)."""

    name = "torch"

    def __init__(self, device: torch.device, deterministic: bool = False):
        self.workspace = reference.Workspace()   # shared by all layers: one backend object per model
        self.kernel = cpu_attention.load() if device.type == "cpu" else None
        # The kernel walks each request's own length: one decode group, no padding to split on.
        self.pads_decodes = self.kernel is None
        self.deterministic = deterministic   # every row as a decode of its own (engine/row_attention.py)
        self.reads_shared_prefixes = self.kernel is not None and not deterministic

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: LayerCache,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """query [T, heads, d], key/value [T, kv_heads, d] -> [T, heads, d]; `window` W: each query sees its
        last W positions; `softcap` c: scores become c * tanh(scores / c)."""
        k, v, k_scale, v_scale = cache
        if self.kernel is not None and cpu_attention.stores_as_computed(key, k, k_scale):
            cpu_attention.write_kv_cache(key, value, k, v, meta.slot_mapping)
        else:
            reference.write_kv_cache(key, value, k, v, meta.slot_mapping, k_scale, v_scale)
        if self.deterministic:
            return self._row_wise(query, cache, meta, scale, window, softcap)
        out = torch.empty_like(query)
        for group in meta.decode_groups:
            if (group.shared_prefixes and k_scale is None and not window
                    and cpu_attention.prefill_supported(query, k)):
                out[group.start:group.end] = self._decode_with_shared_prefixes(query[group.start:group.end], k, v,
                                                                               group, scale, softcap)
                continue
            if self.kernel is not None:
                out[group.start:group.end] = cpu_attention.paged_decode_attention(
                    query[group.start:group.end], k, v, group.block_tables, group.context_lens, scale, k_scale,
                    v_scale, window, softcap)
                continue
            out[group.start:group.end] = reference.paged_decode_attention(
                query[group.start:group.end], k, v, group.block_tables, group.context_lens, scale, k_scale, v_scale,
                group.max_len, self.workspace, window, softcap)
        in_place = meta.prefills and self.kernel is not None and cpu_attention.prefill_supported(query, k)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if in_place:   # over the paged blocks, with or without a cached prefix
                out[rows] = cpu_attention.paged_prefill_attention(query[rows], k, v, chunk.block_table,
                                                                  chunk.context_len, scale, window, softcap)
                continue
            if chunk.query_len == chunk.context_len and k.dtype == key.dtype:
                # Nothing cached before the chunk and the cache stores K/V as computed: the fresh K/V are exactly
                # what a gather would read back, without the copy.
                out[rows] = reference.causal_attention(query[rows], key[rows], value[rows], scale, window,
                                                        softcap)
                continue
            out[rows] = reference.paged_prefill_attention(query[rows], k, v, chunk.block_table, chunk.context_len,
                                                          scale, k_scale, v_scale, window, softcap)
        return out

    @staticmethod
    def _decode_with_shared_prefixes(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup,
                                     scale: float, softcap: float | None) -> torch.Tensor:
        """Each shared prefix once for all its requests, each request's own positions apart, the parts merged."""
        out, lse = cpu_attention.decode_attention_from(query, k, v, group.block_tables, group.context_lens,
                                                       group.own_starts, scale, softcap)
        for prefix in group.shared_prefixes:
            part, part_lse = cpu_attention.shared_prefix_attention(query[prefix.rows], k, v, prefix.block_table,
                                                                   prefix.length, scale, softcap)
            out[prefix.rows] = cpu_attention.merge_parts(part, part_lse, out[prefix.rows], lse[prefix.rows])
        return out

    def _row_wise(self, query: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float,
                  window: int | None, softcap: float | None) -> torch.Tensor:
        """Deterministic mode: each row a decode of its own, reading the cache the step has just written."""
        k, v, k_scale, v_scale = cache
        rows = row_attention.row_tables(meta, query.shape[0], query.device)
        if self.kernel is not None:   # one task per (row, KV head), each over its own keys in order
            return cpu_attention.paged_decode_attention(query, k, v, rows.block_tables, rows.context_lens, scale,
                                                        k_scale, v_scale, window, softcap)
        out = torch.empty_like(query)
        for i, length in enumerate(rows.context_lens.tolist()):   # one row a call: no padding to a longer row
            out[i:i + 1] = reference.paged_decode_attention(
                query[i:i + 1], k, v, rows.block_tables[i:i + 1], rows.context_lens[i:i + 1], scale, k_scale,
                v_scale, length, None, window, softcap)
        return out
