"""The rotated W8A8 activations' quantization on the CPU (rotate_quant.h, built into native_linear's module): each
row's block Hadamard rotation by a fast Walsh-Hadamard transform and its per-row int8 quantization in one pass. In
the whole-model graph the dense rotation (a float32 product with the [block, block] matrix) and the traced
quantization cost the 0.3B Llama shape's W8A8 decode 16 % of its throughput (bench/quantized.py). Also the product's
row scale, in place (scale_rows_)."""
from __future__ import annotations

import torch

from batchrun.kernels import native_linear

load = native_linear.load   # the compiled module, or None (see cpp_build.load)


def quantize(x: torch.Tensor, block: int, flip_sign: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float32, bfloat16 or float16) -> (codes [M, K], float32 scale [M, 1]) of x H: int8 codes, or
    uint8 codes + 128 where flip_sign (for kernels taking unsigned activations, zero point 128). Call only when
    load() returned a module."""
    return native_linear.load().rotate_quantize(x.contiguous(), block, flip_sign)


def scale_rows_(out: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """out [M, N] (contiguous, float32, bfloat16 or float16) times the float32 scale [M, 1], in place, rounded
    once: a W8A8 product's row scale."""
    return native_linear.load().scale_rows_(out, scale)
