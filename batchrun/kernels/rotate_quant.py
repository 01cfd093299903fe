"""The rotated W8A8 activations' quantization on the CPU (rotate_quant.cpp): each row's block Hadamard rotation by a
fast Walsh-Hadamard transform and its per-row int8 quantization in one pass. In the whole-model graph the dense
rotation (a float32 product with the [block, block] matrix) and the traced quantization cost the 0.3B Llama shape's
W8A8 decode 16 % of its throughput (bench/quantized.py)."""
from __future__ import annotations

from pathlib import Path

import torch

from batchrun.kernels import cpp_build

_kernel = cpp_build.Kernel("batchrun_rotate_quant",
                           [Path(__file__).with_name(name) for name in ("rotate_quant.cpp", "cpu_vec.h")],
                           "rotated int8 quantization kernel", "the dense rotation and traced quantization")
load = _kernel.load   # the compiled module, or None (see cpp_build.load)


@torch.library.custom_op("batchrun::rotate_quantize", mutates_args=())
def rotate_quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float32, bfloat16 or float16) -> (int8 [M, K], float32 scale [M, 1]) of x H; call only when load()
    returned a module."""
    q, scale = _kernel.module.rotate_quantize(x.contiguous(), block)
    return q, scale


@rotate_quantize.register_fake
def _(x, block):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[0], 1, dtype=torch.float32)
