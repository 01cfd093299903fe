"""Which slice of the model a tensor-parallel rank holds: `split` reshapes the (meta-device) model's layers to the
rank's sizes, `part` tells the loader which slice of each checkpoint tensor the rank reads (so a rank never reads
the others' weights), `after_load` fixes what slicing cannot express.

Fused tensors are sliced per part before they are joined: the rank's q/k/v rows are its q heads, then its KV
heads' k, then their v; gate/up its rows of gate, then of up. Where the KV heads do not divide by the rank count
but the rank count divides by them, each KV head is replicated on size / kv_heads ranks (vLLM does the same).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchrun.engine.loader import Part
from batchrun.models.layers import GatedMLP, Linear, head_dim_of
from batchrun.models.moe import SparseMoE
from batchrun.engine.parallel.layers import ParallelSparseMoE, RowParallelLinear, VocabParallelEmbedding


def kv_heads_per_rank(kv_heads: int, size: int) -> int:
    if kv_heads % size == 0:
        return kv_heads // size
    if size % kv_heads == 0:
        return 1
    raise ValueError(f"tensor_parallel_size: {size} neither divides nor is a multiple of the model's "
                     f"{kv_heads} KV heads (num_key_value_heads)")


def check(config, size: int) -> None:
    """Refuse, naming the field, a model that does not split evenly over `size` ranks."""
    for field in ("num_attention_heads", "vocab_size"):
        if getattr(config, field) % size:
            raise ValueError(f"tensor_parallel_size: {size} does not divide the model's {field} "
                             f"({getattr(config, field)})")
    kv_heads_per_rank(config.num_key_value_heads, size)


@dataclass
class Shard:
    rank: int
    size: int
    kv_heads: int = 0    # the model's, set by split()
    head_dim: int = 0

    def split(self, model: nn.Module) -> None:
        """Resize the model's layers (on the meta device, before the weights are assigned) to this rank's slice."""
        config = model.config
        check(config, self.size)
        self.kv_heads, self.head_dim = config.num_key_value_heads, head_dim_of(config)
        with torch.device("meta"):
            for layer in model.model.layers:
                self._split_attention(layer.self_attn)
                if isinstance(layer.mlp, GatedMLP):
                    self._split_mlp(layer.mlp)
                elif isinstance(layer.mlp, SparseMoE):
                    self._split_experts(layer.mlp)
                else:
                    raise ValueError(f"tensor_parallel_size: {type(layer.mlp).__name__} layers cannot be split")
            rows = config.vocab_size // self.size
            model.model.embed_tokens = VocabParallelEmbedding(rows, config.hidden_size, self.rank * rows)
            model.lm_head = Linear(config.hidden_size, rows, bias=False)

    def _split_attention(self, attn: nn.Module) -> None:
        if attn.options.qk_norm == "full":
            raise ValueError("tensor_parallel_size: the q/k norm over the whole projection (OLMo 2) needs every "
                             "rank's heads; run this model with tensor_parallel_size 1")
        attn.num_heads //= self.size
        attn.num_kv_heads = kv_heads_per_rank(attn.num_kv_heads, self.size)
        attn.q_size, attn.kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        hidden = attn.qkv_proj.in_features
        attn.qkv_proj = Linear(hidden, attn.q_size + 2 * attn.kv_size, bias=attn.options.qkv_bias)
        attn.o_proj = RowParallelLinear(attn.q_size, hidden, bias=attn.options.o_bias)

    def _split_mlp(self, mlp: GatedMLP) -> None:
        size, hidden = self._even(mlp.down_proj.in_features, "intermediate_size"), mlp.down_proj.out_features
        mlp.gate_up_proj = Linear(hidden, 2 * size, bias=mlp.gate_up_proj.bias is not None)
        mlp.down_proj = RowParallelLinear(size, hidden, bias=mlp.down_proj.bias is not None)

    def _split_experts(self, moe: SparseMoE) -> None:
        experts = moe.experts
        size = experts.intermediate_size = self._even(experts.intermediate_size, "moe intermediate_size")
        experts.gate_up_proj = nn.Parameter(torch.empty(experts.num_experts * 2 * size, experts.hidden_size))
        experts.down_proj = nn.Parameter(torch.empty(experts.num_experts * experts.hidden_size, size))
        moe.__class__ = ParallelSparseMoE   # same state, a forward that sums the ranks' partial results

    def _even(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"tensor_parallel_size: {self.size} does not divide the model's {what} ({n})")
        return n // self.size

    def part(self, name: str, source: str, shape: list[int]) -> Part | None:
        """The slice (dim, start, stop) of checkpoint tensor `source` that this rank reads into its tensor `name`;
        None: all of it (norms, routers, the biases added after an all-reduce)."""
        if ".qkv_proj." in source or ".gate_up_proj." in source:   # a rank's rows are not one run of them
            raise ValueError(f"tensor_parallel_size: the checkpoint stores {source} already fused (Phi-3 does); "
                             f"splitting it is not supported: run this model with tensor_parallel_size 1")
        if ".qkv_proj." in name:
            return self._kv_rows(source, shape[0]) if ".q_proj." not in source else self._slice(0, shape, source)
        if ".gate_up_proj" in name or name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self._slice(0, shape, source)
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            return self._slice(1, shape, source)
        return None

    def _slice(self, dim: int, shape: list[int], source: str) -> Part:
        rows = self._even(shape[dim], f"{source} dimension {dim}")
        return dim, self.rank * rows, (self.rank + 1) * rows

    def _kv_rows(self, source: str, rows: int) -> Part:
        """This rank's KV heads' rows of k_proj or v_proj: a contiguous run of heads, or the one head it shares."""
        if rows != self.kv_heads * self.head_dim:
            raise ValueError(f"model: {source} has {rows} rows, not num_key_value_heads x head_dim "
                             f"({self.kv_heads} x {self.head_dim})")
        local = kv_heads_per_rank(self.kv_heads, self.size)
        first = self.rank * self.kv_heads // self.size if local == 1 else self.rank * local
        return 0, first * self.head_dim, (first + local) * self.head_dim

    def after_load(self, model: nn.Module) -> None:
        """Zero the row-parallel biases outside rank 0 (the all-reduce adds rank 0's once)."""
        if self.rank == 0:
            return
        for module in model.modules():
            if isinstance(module, RowParallelLinear) and module.bias is not None:
                module.bias.data.zero_()
