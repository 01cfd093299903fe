"""A LoRA projection: its base product once for every token, then the low-rank updates of the rows under adapters
(grouped.py: per adapter run, stacked, or SGMV segments), as the MoE layer groups tokens by expert.

On the CPU (oneDNN-packed weights) the resident adapters' stacked A matrices sit under the base weight in one packed
matrix [W; A_1; ...; A_n] (`fuse`): one product yields the base output and every adapter's shrink, one pass over
the weights and one call, where a separate shrink product cost a call of its own (about 18 us of fixed cost) per
projection. The base weight's own packed copy is then dropped (one copy of W), and recovered from the fused one
when the resident set changes.

The step's update is set around the forward by `step(update)` (a context, as graph.step passes attention
segments): the model's code stays the same whichever rows carry which adapter. Inside the whole-model graph the
projection is one opaque op, `batchrun::lora_linear` (base product and update), which reads the update from the
context, so one compiled graph serves any mix of adapters. One op, not the base product's op and an update op
after it: each opaque op call costs about 50 us of Python on the CPU, 4 per layer.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch import nn

from batchrun.models import cpu_gemm, graph

_current = threading.local()


@contextlib.contextmanager
def step(update):
    """Makes `update` (a grouped.PerAdapter, Stacked or Segments; None: no row has an adapter) the one every LoRA
    projection applies during one forward."""
    _current.update = update
    try:
        yield
    finally:
        _current.update = None


@torch.library.custom_op("batchrun::lora_linear", mutates_args=())
def lora_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return graph.lookup(handle)().eager(x)


@lora_linear.register_fake
def _(x, handle, out_features):
    return x.new_empty(x.shape[0], out_features)


class LoraProjection(nn.Module):
    """Wraps one projection of the model: its output plus the step's adapter updates (none for base rows)."""

    def __init__(self, base: nn.Module, name: str):
        super().__init__()
        self.base = base
        self.name = name
        self.in_features, self.out_features = base.in_features, base.out_features
        self.handle = graph.register(self, weakref.ref(self))
        self.fused: torch.Tensor | None = None        # packed [W; stacked A] (CPU), None: the base alone
        self.fused_bias: torch.Tensor | None = None   # the base's bias, then zeros for the shrink's columns

    def fuse(self, a: torch.Tensor | None) -> bool:
        """Pack the base weight with `a` [C, in] (the resident adapters' stacked A; None: none adapts this
        projection) under it; False where the base weight is not oneDNN-packed (quantized, or no packing here)."""
        base = self.base
        if self.fused is not None:
            weight = self.fused.to_dense()[:self.out_features]
        elif base.packed is not None and base.quantized is None:
            weight = base.packed.to_dense()
        else:
            return False
        columns = 0 if a is None else a.shape[0]
        self.fused = cpu_gemm.pack(weight if a is None else torch.cat([weight, a.to(weight.dtype)]))
        if base.packed is not None:   # the fused matrix holds W from now on: drop the base's packed copy
            graph.release(base.handle)
            base.packed, base.handle, base.native = None, None, False
        if base.bias is not None:
            self.fused_bias = torch.cat([base.bias, base.bias.new_zeros(columns)])
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if torch.compiler.is_compiling():
            return torch.ops.batchrun.lora_linear(x, self.handle, self.out_features)
        return self.eager(x)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        """The base product of x [T, in], plus the step's low-rank updates (a contiguous [T, out])."""
        update = getattr(_current, "update", None)
        if self.fused is None:
            y = self.base(x)
            return y if update is None else update.apply(y, x, self.name)
        both = cpu_gemm.linear(x, self.fused, self.fused_bias, self.base.row_tile)
        y = both[:, :self.out_features]
        if update is not None:
            y = update.apply(y, x, self.name, both[:, self.out_features:])
        return y.contiguous()


def wrap(model: nn.Module, projections: set[str]) -> dict[str, LoraProjection]:
    """Replace each named projection of `model` with its LoraProjection (same output until a step has runs)."""
    wrapped = {}
    for name in sorted(projections):
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        wrapped[name] = LoraProjection(getattr(owner, leaf), name)
        setattr(owner, leaf, wrapped[name])
    return wrapped
