"""Self-attention over the paged KV cache, with the per-layer options the families need."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from batchrun.attention_metadata import Segment
from batchrun.models import fused, graph, row_tiles
from batchrun.models.layers import Linear, RMSNorm, head_dim_of


@dataclass(frozen=True)
class AttentionOptions:
    window: int | None = None      # sliding window W: query i sees keys j with i - W < j <= i; None: all
    scale: float | None = None     # softmax scale; None: head_dim ** -0.5
    softcap: float | None = None   # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    qk_norm: str | None = None     # "head": RMSNorm over each head (Qwen3, Gemma 3); "full": over the projection (OLMo 2)
    norm_unit_offset: bool = False # q/k norms with Gemma's (1 + w) weight
    qkv_bias: bool = False
    o_bias: bool = False
    rope: str | None = None        # which RoPE table the layer uses (Gemma 3 keeps one per layer type)


class Attention(nn.Module):
    def __init__(self, config, backend, options: AttentionOptions):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=options.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=options.o_bias)
        if options.qk_norm is not None:
            q_dim, k_dim = ((self.head_dim, self.head_dim) if options.qk_norm == "head"
                            else (self.q_size, self.kv_size))
            self.q_norm = RMSNorm(q_dim, config.rms_norm_eps, options.norm_unit_offset)
            self.k_norm = RMSNorm(k_dim, config.rms_norm_eps, options.norm_unit_offset)
        self.options = options
        self.scale = options.scale or self.head_dim ** -0.5
        self.backend = backend
        self.kv_caches = []       # one LayerCache per KV pool (lane), set by the model runner
        self.kv_rotations = []    # per pool: [d, d] orthogonal matrix for int8 storage (kernels.quant.rotation)
        self.row_tile = 0         # > 0: deterministic mode, the rotations' products on tiles of this many rows
        self.handle = graph.register(self, weakref.ref(self))   # how the whole-model graph's attention op finds it

    def forward(self, x, cos, sin, segments: list[Segment]):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.options.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        if self.options.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = fused.apply_rope(q, cos, sin), fused.apply_rope(k, cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if torch.compiler.is_compiling():   # inside the whole-model graph: the step's segments are graph.step's
            out = torch.ops.batchrun.attention(q, k, v, self.handle)
        else:
            out = self.attend(q, k, v, segments)
        return self.o_proj(out.reshape(-1, self.q_size))

    def attend(self, q, k, v, segments: list[Segment]):
        """Writes k/v to each segment's KV pool and attends; q [T, heads, d], k/v [T, kv_heads, d]."""
        if len(segments) == 1:
            return self._attend(q, k, v, segments[0])
        out = torch.empty_like(q)
        for seg in segments:
            rows = slice(seg.start, seg.end)
            out[rows] = self._attend(q[rows], k[rows], v[rows], seg)
        return out

    def _attend(self, q, k, v, seg: Segment):
        rotation = self.kv_rotations[seg.pool]
        if rotation is not None:   # attention is unchanged by the rotation; int8 storage error shrinks
            q, k, v = self._rotate(q, rotation), self._rotate(k, rotation), self._rotate(v, rotation)
        out = self.backend.forward(q, k, v, self.kv_caches[seg.pool], seg.meta, self.scale,
                                   window=self.options.window, softcap=self.options.softcap)
        return out if rotation is None else self._rotate(out, rotation.T)

    def _rotate(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        if not self.row_tile:
            return x @ rotation
        rows = x.reshape(-1, x.shape[-1])
        return row_tiles.tiled(lambda part: part @ rotation, rows, self.row_tile).view(x.shape)
