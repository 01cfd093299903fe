"""Where an adapter's modules land in batchrun's model, whose q/k/v and gate/up projections are fused
(models/base.py FUSED): each PEFT module maps to a projection and the rows of its output it owns. Per projection,
the adapter's modules become one pair of matrices in nn.Linear's layout: A stacked [sum of ranks, in] and B
block-diagonal [out, sum of ranks] with the scaling folded in, so one adapter costs two small products per
projection."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from batchrun.engine.lora.adapter_file import AdapterFile
from batchrun.models.base import FUSED


@dataclass(frozen=True)
class Target:
    projection: str   # the model's module, e.g. model.layers.0.self_attn.qkv_proj
    rows: slice       # the rows of its output this PEFT module owns


class Weights(NamedTuple):
    """One adapter's matrices on one projection."""
    a: torch.Tensor                       # [R, in]: its modules' A stacked
    b: torch.Tensor                       # [out, R]: their B block-diagonally, scaling folded in
    parts: tuple[tuple[int, int, int], ...]   # per module, in a's row order: (first output row, end row, rank)


def resolve(model: torch.nn.Module, adapter: AdapterFile) -> dict[str, Target]:
    """PEFT module -> Target, every shape checked against the model; the error names the file and the module."""
    targets = {}
    for module, shape in adapter.modules.items():
        parent, _, leaf = module.rpartition(".")
        fused = next(((joined, parts) for parts, joined in FUSED if leaf in parts), None)
        projection = f"{parent}.{fused[0]}" if fused else module
        try:
            base = model.get_submodule(projection)
        except AttributeError:
            base = None
        if base is None or not hasattr(base, "out_features"):
            raise adapter.error(f"module {module!r} is not a projection of this model")
        rows = _part_rows(model.get_submodule(parent), base.out_features, fused[1], leaf) if fused else \
            slice(0, base.out_features)
        want = (base.in_features, rows.stop - rows.start)
        if (shape.in_features, shape.out_features) != want:
            raise adapter.error(f"module {module!r}: lora_A is [{shape.rank}, {shape.in_features}] and lora_B "
                                f"[{shape.out_features}, {shape.rank}]; the base model needs [r, {want[0]}] and "
                                f"[{want[1]}, r] (an adapter for another model?)")
        targets[module] = Target(projection, rows)
    return targets


def _part_rows(parent: torch.nn.Module, out_features: int, parts: tuple[str, ...], leaf: str) -> slice:
    """The output rows of one part of a fused projection: q/k/v by the attention's sizes, else equal parts."""
    if hasattr(parent, "q_size"):
        sizes = [parent.q_size, parent.kv_size, parent.kv_size]
    else:
        sizes = [out_features // len(parts)] * len(parts)
    i = parts.index(leaf)
    return slice(sum(sizes[:i]), sum(sizes[:i + 1]))


def stack(adapter: AdapterFile, targets: dict[str, Target], shapes: dict[str, tuple[int, int]], dtype: torch.dtype,
          device: torch.device) -> dict[str, Weights]:
    """projection -> Weights over the adapter's modules on it."""
    weights = adapter.load(torch.float32)
    by_projection: dict[str, list[str]] = {}
    for module, target in targets.items():
        by_projection.setdefault(target.projection, []).append(module)
    stacked = {}
    for projection, modules in by_projection.items():
        modules.sort(key=lambda m: targets[m].rows.start)
        a = torch.cat([weights[m][0] for m in modules])                       # [R, in]
        b = torch.zeros(shapes[projection][1], a.shape[0])                 # [out, R]
        r = 0
        for m in modules:
            rank = adapter.modules[m].rank
            b[targets[m].rows, r:r + rank] = weights[m][1] * adapter.modules[m].scaling
            r += rank
        parts = tuple((targets[m].rows.start, targets[m].rows.stop, adapter.modules[m].rank) for m in modules)
        stacked[projection] = Weights(a.to(device, dtype), b.to(device, dtype), parts)
    return stacked
