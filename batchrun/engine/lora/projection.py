"""The grouped low-rank update: a projection's base product once for every token, then, per adapter present in
the step, y[rows] += (x[rows] @ A^T) @ B^T on that adapter's contiguous run of rows (the model runner orders each
pool's tokens by adapter), as the MoE layer groups tokens by expert.

The step's runs are set around the forward by `step(runs)` (a context, as graph.step passes attention segments):
the model's code stays the same whichever rows carry which adapter. Inside the whole-model graph the update is
the opaque op `batchrun::lora_add_`, which mutates the projection's output in place and reads the runs from the
context, so one compiled graph serves any mix of adapters.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

# (projection -> (A^T, B^T) of one adapter, first row, end row)
Run = tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int, int]
_current = threading.local()
_names: list[str] = []           # handle -> projection name, for the graph's op (which takes no strings)


@contextlib.contextmanager
def step(runs: list[Run]):
    """Makes `runs` the adapter rows every LoRA projection reads during one forward."""
    _current.runs = runs
    try:
        yield
    finally:
        _current.runs = []


def add_updates(y: torch.Tensor, x: torch.Tensor, projection: str) -> None:
    """y [T, out] += each run's low-rank update of x [T, in], in place (computed in the adapter's dtype)."""
    for weights, start, end in getattr(_current, "runs", ()):
        pair = weights.get(projection)
        if pair is not None:
            a, b = pair
            y[start:end] += ((x[start:end].to(a.dtype) @ a) @ b).to(y.dtype)


@torch.library.custom_op("batchrun::lora_add_", mutates_args=("y",))
def lora_add_(y: torch.Tensor, x: torch.Tensor, handle: int) -> None:
    add_updates(y, x, _names[handle])


class LoraProjection(nn.Module):
    """Wraps one projection of the model: its output plus the step's adapter updates (none for base rows)."""

    def __init__(self, base: nn.Module, name: str):
        super().__init__()
        self.base = base
        self.name = name
        self.in_features, self.out_features = base.in_features, base.out_features
        self.handle = len(_names)
        _names.append(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        y = self.base(x)
        if torch.compiler.is_compiling():
            torch.ops.batchrun.lora_add_(y, x, self.handle)
        else:
            add_updates(y, x, self.name)
        return y


def wrap(model: nn.Module, projections: set[str]) -> None:
    """Replace each named projection of `model` with its LoraProjection (same output until a step has runs)."""
    for name in sorted(projections):
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, LoraProjection(getattr(owner, leaf), name))
