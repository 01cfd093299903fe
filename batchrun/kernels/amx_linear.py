"""bfloat16 linear layers on AMX tiles (amx_linear.cpp), where the CPU has AMX-BF16: the weight packed once into the
order the tile loop streams it, the product in one pass over the weight for up to 32 rows at a time.

A decode step's products are bound by reading the weights from memory. oneDNN's packed bfloat16 product reached
8.0-8.3 GB/s of weights on SmolLM2's four layer shapes at 32 rows, cold (one thread of an Intel Xeon with AMX, the
machine reads about 12.6 GB/s); this kernel 10.0-10.7 GB/s, and the same as oneDNN up to 512 rows
(tests/test_amx_linear.py checks it against a float32 product). Built once per machine (cpp_build.py); where it
cannot be built, or the CPU or OS gives no AMX, `available()` is False and the layers stay on oneDNN.
"""
from __future__ import annotations

from pathlib import Path

import torch

from batchrun.cpuinfo import cpu_flags
from batchrun.kernels import cpp_build

INPUT_MULTIPLE = 32   # the packed layout's step over the inputs; other widths stay on oneDNN

_kernel = cpp_build.Kernel("batchrun_amx_linear",
                           [Path(__file__).with_name(name) for name in ("amx_linear.cpp", "amx.h")],
                           "AMX linear kernel", "oneDNN's packed products")


class PackedWeight:
    """A weight [out_features, in_features] in the kernel's layout (zero-padded to 32 outputs)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.tiles = _kernel.module.pack(weight.detach().contiguous())

    def to_dense(self) -> torch.Tensor:
        """The weight [out_features, in_features] back from the tiles."""
        blocks, pairs = self.tiles.shape[:2]
        return self.tiles.permute(0, 2, 1, 3).reshape(blocks * 32, pairs * 2)[:self.out_features]


def available() -> bool:
    """Whether bfloat16 layers can run here: the CPU has AMX-BF16, the kernel built, the OS grants the tiles."""
    if not {"amx_bf16", "amx_tile"} <= cpu_flags():
        return False
    module = _kernel.load()
    return module is not None and module.ready()


def packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % INPUT_MULTIPLE == 0 and available())


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in_features] bfloat16 @ W^T (+ bias) -> [rows, out_features] bfloat16."""
    return _kernel.module.linear(x.contiguous(), packed.tiles, packed.out_features, bias)
