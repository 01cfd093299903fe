"""The layers a tensor-parallel rank swaps in: each holds its rank's slice and sums the partial results over the
ranks where the math needs it (one all-reduce per row-parallel product, one per embedding lookup)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.models.layers import Linear
from batchrun.models.moe import SparseMoE
from batchrun.engine.parallel import group


class RowParallelLinear(Linear):
    """A product over the rank's slice of the input features (o_proj, down_proj): partial sums, all-reduced. The
    bias is added on rank 0 only (the other ranks hold zeros), so the sum carries it once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """The rank's rows [start, stop) of the embedding: ids outside them look up zeros, and the sum over the ranks
    is each id's row."""

    def __init__(self, rows: int, hidden_size: int, start: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.start = start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return group.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


class ParallelSparseMoE(SparseMoE):
    """Every expert's gated MLP over the rank's slice of its intermediate size: the routed sum is partial too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(super().forward(x))
