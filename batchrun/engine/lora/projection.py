"""A LoRA projection: its base product once for every token, then the low-rank updates of the rows under adapters
(grouped.py: per adapter run, stacked, or SGMV segments), as the MoE layer groups tokens by expert.

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

from batchrun.models import graph

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if torch.compiler.is_compiling():
            return torch.ops.batchrun.lora_linear(x, self.handle, self.out_features)
        return self.eager(x)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        """The base product of x [T, in], plus the step's low-rank updates (in place or into a new tensor)."""
        y = self.base(x)
        update = getattr(_current, "update", None)
        return y if update is None else update.apply(y, x, self.name)


def wrap(model: nn.Module, projections: set[str]) -> None:
    """Replace each named projection of `model` with its LoraProjection (same output until a step has runs)."""
    for name in sorted(projections):
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, LoraProjection(getattr(owner, leaf), name))
