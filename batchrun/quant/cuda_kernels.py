"""Quantized products on CUDA: the Triton dequant-GEMMs of batchrun/kernels/quant_gemm.py for int8 and int4,
torch._scaled_mm for fp8 (row-wise scales: Hopper / Ada). They read the canonical weights as they are (no CPU
packing). W8A8 int8 activations are quantized per token and widened again before the weight-only kernel (the
same product, emulated)."""
from __future__ import annotations

import torch

from batchrun.quant.quantize import fake_quantize_rows
from batchrun.quant.weights import QuantizedWeight


def _quant_gemm():
    try:
        from batchrun.kernels import quant_gemm
    except ImportError as exc:
        raise ValueError("model: quantized weights on CUDA need batchrun.kernels.quant_gemm (Triton), which this "
                         f"install lacks ({exc})") from exc
    return quant_gemm


def make(w: QuantizedWeight):
    if w.kind == "fp8":
        scale_b = w.scale.float()[None, :]

        def fp8(x: torch.Tensor) -> torch.Tensor:
            fx, scale_a = fake_quantize_rows(x, "fp8", w.input_scale)
            if w.activations == "none":   # W8A16: the activations in e4m3 lose precision; widen the weight
                return torch.nn.functional.linear(x, w.data.to(x.dtype)) * scale_b.to(x.dtype)
            out = torch._scaled_mm(fx, w.data.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
            return out.to(x.dtype)
        return fp8
    gemm = _quant_gemm()
    if w.kind == "int4":
        def int4(x: torch.Tensor) -> torch.Tensor:
            rows = x if w.input_perm is None else x.index_select(1, w.input_perm)
            return gemm.int4_linear(rows, w.data, w.scale, w.zeros, w.group_size, None)
        return int4

    def int8(x: torch.Tensor) -> torch.Tensor:
        if w.activations == "int8":
            qx, row_scale = fake_quantize_rows(x, "int8", w.input_scale)
            x = (qx.float() * row_scale).to(x.dtype)
        return gemm.int8_linear(x, w.data, w.scale, None)
    return int8
