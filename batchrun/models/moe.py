"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): top-k routing, tokens grouped by expert, one product per active
expert.

Experts are stacked from the checkpoint's per-expert tensors (the hub layout, e.g. `experts.3.w1.weight`) into
`gate_up_proj` [E * 2I, H] and `down_proj` [E * H, I], viewed per expert at run time.
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.models import cpu_gemm, row_tiles
from batchrun.models.attention import AttentionOptions
from batchrun.models.base import CausalLM, checkpoint_plan
from batchrun.models.layers import ACTIVATIONS, GatedMLP, Linear, activation


class Experts(nn.Module):
    """The experts' weights, stacked; `project(expert, rows)` runs one expert's gated MLP on its rows."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act_and_mul):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts * 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts * hidden_size, intermediate_size))
        self.act_and_mul = act_and_mul
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.row_tile = 0   # > 0: deterministic mode, every product on tiles of this many rows (row_tiles.py)

    def weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert: views into the stacks."""
        i, h = self.intermediate_size, self.hidden_size
        return (self.gate_up_proj[expert * 2 * i:(expert + 1) * 2 * i],
                self.down_proj[expert * h:(expert + 1) * h])

    def pack_for_cpu(self) -> bool:
        """oneDNN-packed copies of each expert's two matrices (about 25% faster at decode's few rows per expert)."""
        packed = [tuple(cpu_gemm.pack(w) for w in self.weights(e)) for e in range(self.num_experts)]
        self.packed = packed if all(p is not None for pair in packed for p in pair) else None
        return self.packed is not None

    def project(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        tile = self.row_tile
        if self.packed is not None:
            gate_up, down = self.packed[expert]
            return cpu_gemm.linear(self.act_and_mul(cpu_gemm.linear(rows, gate_up, None, tile)), down, None, tile)
        gate_up, down = self.weights(expert)
        if tile:
            hidden = row_tiles.tiled(lambda part: F.linear(part, gate_up), rows, tile)
            return row_tiles.tiled(lambda part: F.linear(part, down), self.act_and_mul(hidden), tile)
        return F.linear(self.act_and_mul(F.linear(rows, gate_up)), down)


class SparseMoE(nn.Module):
    """Router `gate` [E, H]; each token goes to its top-k experts by softmax probability, weighted by those
    probabilities (renormalised over the k when `normalize`)."""

    def __init__(self, config, num_experts: int, top_k: int, intermediate_size: int, normalize: bool):
        super().__init__()
        self.gate = Linear(config.hidden_size, num_experts, bias=False)
        # Eager activation: per expert the rows are few, and a compiled call's guards (~0.2 ms) cost more than
        # fusion saves.
        self.experts = Experts(num_experts, config.hidden_size, intermediate_size,
                               ACTIVATIONS[activation(config)].eager)
        self.top_k, self.normalize = top_k, normalize
        self.expert_products = 0   # experts run so far (each one gate_up and one down product): grouping shows here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)          # [T, k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # Sort the T*k (token, expert) pairs by expert: each expert's tokens are one contiguous slice.
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.experts.num_experts).tolist()
        rows = x[tokens]
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                part = slice(start, start + count)
                out[part] = self.experts.project(expert, rows[part])
                self.expert_products += 1
                start += count
        out *= weights.flatten()[order].to(out.dtype)[:, None]
        # Each token's contributions are added in ascending expert order, as transformers adds them.
        return torch.zeros_like(x).index_add_(0, tokens, out)


def expert_plan(names: list[str], block: str, projections: tuple[str, str, str], num_experts: int
                ) -> dict[str, tuple[str, ...]]:
    """Stacked expert tensors of every MoE layer -> the checkpoint's per-expert tensors (layer.{block}.experts.N.P)."""
    gate, up, down = projections
    layers = sorted({int(m.group(1)) for n in names if (m := re.match(rf"model\.layers\.(\d+)\.{block}\.experts\.", n))})
    plan = {}
    for i in layers:
        source = f"model.layers.{i}.{block}.experts"
        plan[f"model.layers.{i}.mlp.experts.gate_up_proj"] = tuple(
            f"{source}.{e}.{p}.weight" for e in range(num_experts) for p in (gate, up))
        plan[f"model.layers.{i}.mlp.experts.down_proj"] = tuple(f"{source}.{e}.{down}.weight"
                                                                for e in range(num_experts))
    return plan


class MixtralForCausalLM(CausalLM):
    """Every layer's MLP is `block_sparse_moe` in the checkpoint: router `gate`, experts' w1 (gate), w3 (up), w2
    (down); top-k weights always renormalised."""
    whole_graph = False   # expert routing has data-dependent shapes

    def make_mlp(self, layer: int) -> nn.Module:
        c = self.config
        return SparseMoE(c, c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, normalize=True)

    def checkpoint_plan(self, names: list[str]) -> dict[str, tuple[str, ...]]:
        plan = checkpoint_plan([n for n in names if ".experts." not in n], self.config.tie_word_embeddings)
        plan = {name.replace(".block_sparse_moe.", ".mlp."): sources for name, sources in plan.items()}
        return plan | expert_plan(names, "block_sparse_moe", ("w1", "w3", "w2"), self.config.num_local_experts)


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3 attention; MoE on the layers `decoder_sparse_step` selects, outside `mlp_only_layers` (dense there)."""
    whole_graph = False   # expert routing has data-dependent shapes

    def attention_options(self, layer: int) -> AttentionOptions:
        return replace(super().attention_options(layer), qk_norm="head")

    def is_sparse(self, layer: int) -> bool:
        c = self.config
        return (layer not in (c.mlp_only_layers or []) and c.num_experts > 0
                and (layer + 1) % c.decoder_sparse_step == 0)

    def make_mlp(self, layer: int) -> nn.Module:
        c = self.config
        if not self.is_sparse(layer):
            return GatedMLP(c)
        return SparseMoE(c, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob)

    def checkpoint_plan(self, names: list[str]) -> dict[str, tuple[str, ...]]:
        plan = checkpoint_plan([n for n in names if ".experts." not in n], self.config.tie_word_embeddings)
        return plan | expert_plan(names, "mlp", ("gate_proj", "up_proj", "down_proj"), self.config.num_experts)
