"""A step's low-rank updates y += (x @ A^T) @ B^T, each row under its own adapter, computed one of three ways:

- PerAdapter: for each run of rows under one adapter (the model runner orders a pool's tokens by adapter), two
  products on that run's rows: the least arithmetic, but two calls per adapter present per projection;
- Stacked (CPU): the resident adapters' A matrices stacked (a Stack, rebuilt when the resident set changes) and
  packed under the base weight (projection.py), so the base product also yields every adapter's shrink; the
  expand through the C++ kernel (kernels/lora_expand.py: each run of rows its own adapter's nonzero B blocks), or
  where it cannot be built one oneDNN product over all adapters' B side by side, each row's columns of other
  adapters zeroed by a mask built once per step per column layout and shared by every layer. At most one call
  beyond the base product per projection whatever the adapter count; every row pays for every resident adapter's
  shrink;
- Segments (CUDA, `AdapterSet.segmented`): the SGMV kernels (kernels/lora_sgmv.py) over the stacked weights, each
  run of rows reading only its own adapter's columns.

On the CPU a oneDNN product costs about 18 us before any arithmetic (a 16x576x64 bfloat16 product took 19 us, a
16x576x960 one 40 us; Xeon with AMX, one thread), so a decode step's many small per-adapter products cost more
than the stacked path's wasted columns; large prefill chunks are the other way round (stacked_wins).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchrun.engine.lora.targets import Weights
from batchrun.kernels import lora_expand
from batchrun.models import cpu_gemm

# (projection -> one adapter's Weights, first row, end row)
Run = tuple[dict[str, Weights], int, int]
# Multiply-adds the stacked path may waste per product call it saves before the per-adapter path wins (the per-adapter
# products run unpacked). SmolLM2 bfloat16, 4 rank-16 adapters on every projection, rows spread evenly (Xeon with
# AMX, one thread): stacked 214 output tok per CPU second, per adapter 149, base model 276; the stacked path won at
# every step there, 1,024-row prefill chunks included (3 x 7.3 M multiply-adds wasted per row, 3 x 240 calls
# saved per step): 32 M is above that. float32's small products run through MKL at ~4 us a call: 2 M.
WASTE_PER_SAVED_CALL = {torch.bfloat16: 32_000_000, torch.float32: 2_000_000}
# Up to this many rows the stacked path adds its expand product to y inside oneDNN's call (a binary post-op); past
# it y.addmm_ (MKL, accumulating into y) is faster: bfloat16 16 x 128 -> 3072 52.7 vs 62.1 us, 64 rows 146 vs 114,
# 798 rows 2,047 vs 760 (a separate add of the product cost more than either: 1,250 us at 798 rows).
FUSED_ADD_ROWS = 32


@dataclass
class Stack:
    """One projection's resident adapters side by side: A [C, in] (None on the CPU, where it sits under the base
    weight in the projection's fused matrix, projection.py), `columns[name]` = (first column, rank), `owner` [C] =
    each column's adapter's position in the set's order (shared by every projection with the same layout). The
    expand's B either for the CPU kernel (kernels/lora_expand.py: `bt`, each module's nonzero block transposed and
    flattened, `pieces` and `first` its tables) or as one matrix B [out, C] (on the CPU also packed)."""
    a: torch.Tensor | None
    columns: dict[str, tuple[int, int]]
    owner: torch.Tensor
    b: torch.Tensor | None = None
    b_packed: torch.Tensor | None = None
    bt: torch.Tensor | None = None
    pieces: torch.Tensor | None = None
    first: torch.Tensor | None = None


def build_stacks(resident: dict[str, dict[str, Weights]], shapes: dict[str, tuple[int, int]], pack: bool,
                 kernel: bool) -> dict[str, Stack]:
    """projection -> Stack over the resident adapters (in `resident`'s order) that adapt it; `kernel`: B for the
    expand kernel, else one matrix (`pack`: also oneDNN-packed)."""
    order = {name: i for i, name in enumerate(resident)}
    owners: dict[tuple, torch.Tensor] = {}
    stacks = {}
    for projection in shapes:
        pairs = [(name, weights[projection]) for name, weights in resident.items() if projection in weights]
        if not pairs:
            continue
        layout = tuple((name, w.a.shape[0]) for name, w in pairs)
        device = pairs[0][1].a.device
        if layout not in owners:
            owners[layout] = torch.tensor([order[name] for name, rank in layout for _ in range(rank)], device=device)
        columns, start = {}, 0
        for name, rank in layout:
            columns[name] = (start, rank)
            start += rank
        stack = stacks[projection] = Stack(torch.cat([w.a for _, w in pairs]), columns, owners[layout])
        if kernel:
            stack.bt, stack.pieces, stack.first = _kernel_tables(pairs, columns, order, device)
        else:
            stack.b = torch.cat([w.b for _, w in pairs], dim=1)
            stack.b_packed = cpu_gemm.pack_onednn(stack.b) if pack else None
    return stacks


def _kernel_tables(pairs: list[tuple[str, Weights]], columns: dict[str, tuple[int, int]], order: dict[str, int],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expand kernel's B^T blocks and tables (lora_expand.cpp): a piece per module, an adapter's pieces
    together, first[p] = adapter position p's first piece."""
    blocks, pieces, counts, offset = [], [], [0] * (len(order) + 1), 0
    for name, w in pairs:
        local = 0   # the part's first column in this adapter's own B
        for start, end, rank in w.parts:
            blocks.append(lora_expand.flat_block(w.b[start:end, local:local + rank].T))
            pieces.append((start, end, columns[name][0] + local, rank, offset))
            offset += len(blocks[-1])
            local += rank
        counts[order[name] + 1] = len(w.parts)
    first = torch.tensor(counts).cumsum(0)
    return torch.cat(blocks), torch.tensor(pieces, device=device), first.to(device)


def stacked_wins(rows: int, runs: list[Run], own_macs: list[int], stack_macs: int, projections: int,
                 dtype: torch.dtype) -> bool:
    """Whether the stacked path's wasted multiply-adds (every row times the other resident adapters' matrices,
    `*_macs` per row over all projections) cost less than the product calls it saves (two per projection for each
    run beyond the first)."""
    waste = rows * stack_macs - sum(macs * (end - start) for macs, (_, start, end) in zip(own_macs, runs))
    return waste <= 2 * projections * (len(runs) - 1) * WASTE_PER_SAVED_CALL.get(dtype, 0)


class PerAdapter:
    def __init__(self, runs: list[Run]):
        self.runs = runs

    def apply(self, y: torch.Tensor, x: torch.Tensor, projection: str, shrunk=None) -> torch.Tensor:
        for weights, start, end in self.runs:
            pair = weights.get(projection)
            if pair is not None:
                y[start:end].addmm_(F.linear(x[start:end], pair.a), pair.b.T)
        return y


class Stacked:
    def __init__(self, stacks: dict[str, Stack], row_owner: torch.Tensor, runs: torch.Tensor):
        self.stacks, self.row_owner = stacks, row_owner   # row_owner [T]: each row's adapter position, -1: base
        self.runs = runs   # [R, 3]: (first row, end row, adapter position) per run of rows under one adapter
        self.masks: dict[int, torch.Tensor] = {}

    def apply(self, y: torch.Tensor, x: torch.Tensor, projection: str,
              shrunk: torch.Tensor | None = None) -> torch.Tensor:
        """y + each row's own adapter's update; `shrunk`: x @ stacked A^T where the base product computed it."""
        stack = self.stacks.get(projection)
        if stack is None:
            return y
        h = shrunk if stack.a is None else F.linear(x, stack.a)
        if stack.bt is not None:   # the expand kernel: each run's own adapter only, no mask
            return lora_expand.expand(y, h, stack.bt, stack.pieces, stack.first, self.runs)
        mask = self.masks.get(id(stack.owner))
        if mask is None:
            mask = self.masks[id(stack.owner)] = (self.row_owner[:, None] == stack.owner[None, :]).to(x.dtype)
        h = h.mul_(mask)
        if stack.b_packed is not None and len(x) <= FUSED_ADD_ROWS:   # y + h @ B^T in one oneDNN call
            return torch.ops.mkldnn._linear_pointwise.binary(h, y, stack.b_packed, None, "add")
        return y.addmm_(h, stack.b.T) if y.is_contiguous() else torch.addmm(y, h, stack.b.T)


class Segments:
    """The CUDA way: per projection one SGMV shrink and one expand launch over the stacked weights, each run of rows
    (a segment) reading only its own adapter's columns."""

    def __init__(self, stacks: dict[str, Stack], runs: list[tuple[str, int, int]], device: torch.device):
        from batchrun.kernels import lora_sgmv
        self.sgmv, self.stacks, self.runs, self.device = lora_sgmv, stacks, runs, device
        self.tables: dict[int, tuple[torch.Tensor, int]] = {}   # per column layout: launch table, largest rank

    def apply(self, y: torch.Tensor, x: torch.Tensor, projection: str, shrunk=None) -> torch.Tensor:
        stack = self.stacks.get(projection)
        if stack is None:
            return y
        if id(stack.owner) not in self.tables:
            segments = [(start, end, *stack.columns[name]) for name, start, end in self.runs if name in stack.columns]
            self.tables[id(stack.owner)] = (self.sgmv.tiles(segments, self.device),
                                            max((rank for *_, rank in segments), default=0))
        table, max_rank = self.tables[id(stack.owner)]
        if len(table):
            h = self.sgmv.shrink(x if x.stride(1) == 1 else x.contiguous(), stack.a, table, max_rank)
            self.sgmv.expand(y, h, stack.b, table)
        return y
