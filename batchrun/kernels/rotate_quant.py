"""The rotated W8A8 activations' quantization on the CPU (rotate_quant.cpp): each row's block Hadamard rotation by a
fast Walsh-Hadamard transform and its per-row int8 quantization in one pass. In the whole-model graph the dense
rotation (a float32 product with the [block, block] matrix) and the traced quantization cost the 0.3B Llama shape's
W8A8 decode 16 % of its throughput (bench/quantized.py). Also the product's row scale, in place (scale_rows_)."""
from __future__ import annotations

from pathlib import Path

import torch

from batchrun.kernels import cpp_build

_kernel = cpp_build.Kernel("batchrun_rotate_quant",
                           [Path(__file__).with_name(name) for name in ("rotate_quant.cpp", "cpu_vec.h")],
                           "rotated int8 quantization kernel", "the dense rotation and traced quantization")
load = _kernel.load   # the compiled module, or None (see cpp_build.load)


def quantize(x: torch.Tensor, block: int, flip_sign: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float32, bfloat16 or float16) -> (codes [M, K], float32 scale [M, 1]) of x H: int8 codes, or
    uint8 codes + 128 where flip_sign (for kernels taking unsigned activations, zero point 128). Call only when
    load() returned a module."""
    return _kernel.module.rotate_quantize(x.contiguous(), block, flip_sign)


def scale_rows_(out: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """out [M, N] (contiguous, float32, bfloat16 or float16) times the float32 scale [M, 1], in place, rounded
    once: a W8A8 product's row scale."""
    return _kernel.module.scale_rows_(out, scale)
