"""Linear layers on AMX tiles (amx_linear.cpp), where the CPU has AMX: bfloat16 layers, and W8A8 int8 products
(quant/cpu_kernels.py). The weight is packed once into the order the tile loop streams it; the product runs in one
pass over the weight for up to 32 rows at a time.

A decode step's products are bound by reading the weights. One thread of an Intel Xeon with AMX (480 MiB L3: the
weights of 30 SmolLM2 layers come from L3), SmolLM2's four layer products at 32 rows: oneDNN's packed bfloat16
product 0.85-0.90 ms a layer, this kernel 0.66-0.74; int8 on the 0.3B Llama's shapes 1.39 ms against oneDNN
qlinear's 1.83. At prefill sizes it is equal or slower (bfloat16, 256 rows: 2.28 against 2.26 ms a layer;
1,034 rows: 7.9 against 7.0). On the bench's jobs (bench/vs_vllm.py, bfloat16, one thread) the two together gained
SmolLM2 +5-10 % and the 0.3B Llama +5-10 % output tokens per CPU second over oneDNN, the prefill panels another
0-7 %. tests/test_amx_linear.py checks it
against float32 and int32 products. Built once per machine (cpp_build.py); where it cannot be built, or the CPU or
OS gives no AMX (or BATCHRUN_CPU_AMX=0), `available()` is False and the layers stay on oneDNN.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from batchrun.cpuinfo import cpu_flags
from batchrun.kernels import cpp_build

ROW_BYTES_MULTIPLE = 64   # a weight row's bytes must be whole steps (32 bfloat16 or 64 int8 inputs)

_kernel = cpp_build.Kernel("batchrun_amx_linear",
                           [Path(__file__).with_name(name) for name in ("amx_linear.cpp", "amx.h")],
                           "AMX linear kernel", "oneDNN's packed products")


class PackedWeight:
    """A bfloat16 or int8 weight [out_features, in_features] in the kernel's layout (zero-padded to 32 outputs)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        module = _kernel.load()
        if module is None:
            raise RuntimeError("the AMX linear kernel is not available here (see the log)")
        self.tiles = module.pack(weight.detach().contiguous())

    def to_dense(self) -> torch.Tensor:
        """The weight [out_features, in_features] back from the tiles."""
        blocks, groups, _, group = self.tiles.shape
        return self.tiles.permute(0, 2, 1, 3).reshape(blocks * 32, groups * group)[:self.out_features]


@functools.cache
def available() -> bool:
    """Whether the kernel can run here: the CPU has AMX-BF16 and AMX-INT8, it built, the OS grants the tiles."""
    if not {"amx_bf16", "amx_int8", "amx_tile"} <= cpu_flags():
        return False
    module = _kernel.load()
    return module is not None and module.ready()


def packable(weight: torch.Tensor) -> bool:
    """A CPU bfloat16 or int8 [N, K] weight whose rows are whole steps, where the kernel runs."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.int8) and weight.dim() == 2
            and weight.shape[1] * weight.element_size() % ROW_BYTES_MULTIPLE == 0 and available())


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in_features] bfloat16 @ W^T (+ bias) -> [rows, out_features] bfloat16."""
    return _kernel.module.linear(x.contiguous(), packed.tiles, packed.out_features, bias)


def int8_product(qx: torch.Tensor, packed: PackedWeight, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """qx [rows, in_features] int8 @ W^T (int8) x scale [out_features] -> [rows, out_features] in `dtype` (float32
    or bfloat16), without the activations' row scale."""
    return _kernel.module.int8_product(qx.contiguous(), packed.tiles, packed.out_features, scale, dtype)
