"""Per-step attention metadata and the attention backend that reads and writes the paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchrun.engine.kv_cache import LayerCache
from batchrun.kernels import cpu_attention, reference


@dataclass
class PrefillChunk:
    query_start: int        # offset of the chunk's first token in the step's token dimension
    query_len: int
    context_len: int        # tokens of the request in the cache after this step, the chunk included
    block_table: torch.Tensor


@dataclass
class DecodeGroup:
    """Consecutive decode requests of similar context length, padded together to `max_len`."""
    start: int
    end: int
    block_tables: torch.Tensor   # [end - start, max_blocks]
    context_lens: torch.Tensor   # [end - start], the new token included
    max_len: int


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner; decode requests come first in the token dimension."""
    slot_mapping: torch.Tensor                 # [T] cache slot of each new token, -1 to skip
    num_decodes: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


@dataclass
class Segment:
    """Consecutive rows of the step's tokens whose K/V live in one KV pool (one lane)."""
    start: int
    end: int
    pool: int
    meta: AttentionMetadata


class TorchAttentionBackend:
    """Decodes: on CPU the compiled kernel (kernels/cpu_attention.py) over all decode requests at once, reading the
    paged pool in place; without it, the pure-torch path vectorised over groups of similar context length (so
    padding stays small). Prefill chunks one request at a time (few per step)."""

    name = "torch"

    def __init__(self, device: torch.device):
        self.workspace = reference.Workspace()   # shared by all layers: one backend object per model
        self.kernel = cpu_attention.load() if device.type == "cpu" else None
        # The kernel walks each request's own length: one decode group, no padding to split on.
        self.pads_decodes = self.kernel is None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: LayerCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query [T, heads, d], key/value [T, kv_heads, d] -> [T, heads, d]."""
        k, v, k_scale, v_scale = cache
        reference.write_kv_cache(key, value, k, v, meta.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(query)
        for group in meta.decode_groups:
            if self.kernel is not None:
                out[group.start:group.end] = cpu_attention.paged_decode_attention(
                    query[group.start:group.end], k, v, group.block_tables, group.context_lens, scale, k_scale,
                    v_scale)
                continue
            out[group.start:group.end] = reference.paged_decode_attention(
                query[group.start:group.end], k, v, group.block_tables, group.context_lens, scale, k_scale, v_scale,
                group.max_len, self.workspace)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if chunk.query_len == chunk.context_len and k.dtype == key.dtype:
                # Nothing cached before the chunk and the cache stores K/V as computed: the fresh K/V are exactly
                # what a gather would read back, without the copy.
                out[rows] = reference.causal_attention(query[rows], key[rows], value[rows], scale)
                continue
            out[rows] = reference.paged_prefill_attention(query[rows], k, v, chunk.block_table, chunk.context_len,
                                                          scale, k_scale, v_scale)
        return out


def get_backend(name: str, device: torch.device):
    """auto: triton on CUDA, torch elsewhere; "triton" on CPU runs only under TRITON_INTERPRET=1 (tests)."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from batchrun.engine.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(device)
    if name in ("auto", "torch"):
        return TorchAttentionBackend(device)
    raise ValueError(f"attention_backend: {name!r} is not available; allowed: auto, torch, triton")
