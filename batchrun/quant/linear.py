"""A Linear layer's product through a quantized kernel: which kernel runs each format on each device, and the
opaque op `batchrun::quant_linear` that runs it inside the whole-model torch.compile graph (found by handle, as
the packed float weights are, graph.py).

CPU choice (measured, cpu_kernels.py): int8 W8A8 -> batchrun's AMX kernel where the CPU has AMX, else oneDNN
qlinear (aten._int_mm where this torch lacks it),
int8 W8A16 -> aten._weight_int8pack_mm (the weight widened for a dense product from 128 rows and at float32),
fp8 -> emulated (e4m3 widened at each call), int4 -> aten's int4pack (at float32 compute, the nibbles widened for a
dense product).
"""
from __future__ import annotations

from typing import Callable

import torch

from batchrun.kernels import amx_linear, native_linear, rotate_quant
from batchrun.models import graph
from batchrun.quant import cpu_kernels
from batchrun.quant.quantize import fake_quantize_rows
from batchrun.quant.rotation import hadamard, rotate
from batchrun.quant.weights import QuantizedWeight

Kernel = Callable[[torch.Tensor], torch.Tensor]


def cpu_kernel_name(weight: QuantizedWeight, dtype: torch.dtype | None = None) -> str:
    """dtype: the compute dtype, where known (int4 at float32 widens its nibbles: aten's int4pack is scalar there)."""
    if weight.kind == "int4" and dtype == torch.float32:
        return "int4-widened"
    if weight.kind == "int8":
        if weight.activations == "none":
            return "w8a16"
        if amx_linear.packable(weight.data):
            return "w8a8-amx"
        onednn = hasattr(torch.ops.onednn, "qlinear_prepack") and cpu_kernels.onednn_int8_runs_fast()
        return "w8a8-onednn" if onednn else "w8a8-intmm"
    return {"fp8": "fp8-dequant", "int4": "int4"}[weight.kind]


class Concatenated:
    """Fused projections that cannot share one kernel (GPTQ act-order: each has its own input order): each runs
    on the input, the outputs side by side."""

    def __init__(self, kernels: list[Kernel]):
        self.kernels = kernels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([kernel(x) for kernel in self.kernels], dim=1)


def make_kernel(parts: list[QuantizedWeight], dtype: torch.dtype | None = None) -> Kernel:
    """The kernel for one layer from its canonical weight(s) (one per distinct input order), for activations of
    the compute dtype `dtype` (None: any)."""
    def one(weight: QuantizedWeight) -> Kernel:
        if weight.data.device.type == "cuda":
            from batchrun.quant import cuda_kernels
            return cuda_kernels.make(weight)
        return cpu_kernels.KERNELS[cpu_kernel_name(weight, dtype)](weight)
    kernels = [one(part) for part in parts]
    return kernels[0] if len(kernels) == 1 else Concatenated(kernels)


class QuantizedLinear:
    """Set on a Linear (its `quantized`) by the loader; called with the layer's input and bias. `rotation`: the
    Hadamard block size the weight was quantized under (rotation.py): the input is rotated first."""

    def __init__(self, owner, kernel: Kernel, out_features: int, description: str, nbytes: int,
                 rotation: int | None = None, device: torch.device | str = "cpu"):
        self.kernel, self.out_features, self.description = kernel, out_features, description
        self.nbytes = nbytes   # the canonical weight's (codes, scales, zero points): what the layer holds
        self.handle = graph.register(owner, kernel)
        self.rotation, self.rotation_matrix = rotation, None if rotation is None else hadamard(rotation).to(device)
        self.w8a8 = isinstance(kernel, cpu_kernels.W8A8)   # the CPU's: the activations' quantization is ours
        # rotated W8A8 on the CPU: rotation and quantization in one pass (rotate_quant.h) where it builds
        self.fused_rotation = self.w8a8 and rotation is not None and rotate_quant.load() is not None
        # ... and all of it in one C++ operator where the product is oneDNN's (native_linear.cpp)
        self.native = (self.fused_rotation and isinstance(kernel, cpu_kernels.Int8OneDNN)
                       and native_linear.register(owner, self.handle, kernel.packed, kernel.scale, kernel.zero_points))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows, dtype = x.reshape(-1, x.shape[-1]), x.dtype
        if self.native:
            out = torch.ops.batchrun_native.rotated_w8a8(rows, self.handle, self.out_features, self.rotation)
        elif self.fused_rotation:
            # One opaque op: rotation, quantization (straight into the kernel's form of the codes), product, row
            # scale. As two ops (the quantization's, the product's) with the sign flip and row scale between them,
            # they took 147 us a product beside oneDNN's, against 109 us, in one torch-profiler run each (0.3B
            # Llama shape, 32 rows, AMD EPYC; forward 80.0 -> 73.9 ms a decode step). End to end the gain was
            # within that machine's noise (README, quantized weights).
            out = (torch.ops.batchrun.rotated_w8a8(rows, self.handle, self.out_features, self.rotation)
                   if torch.compiler.is_compiling() else self.kernel.rotated_product(rows, self.rotation))
        elif self.w8a8:
            # The activations' quantization and the row scale are traced in the whole-model graph, so inductor
            # fuses them with the elementwise work around the layer; only the int8 product is opaque. Run eagerly
            # around the op they took 1.4 s beside the products' 2.4 s (0.3B Llama shape, 32 rows, 64 steps).
            qx, row_scale = self._quantized_rows(rows)
            if torch.compiler.is_compiling():
                out = (torch.ops.batchrun.quant_product(qx, self.handle, self.out_features, dtype) * row_scale
                       ).to(dtype)
            else:
                out = self.kernel.scaled_product(qx, row_scale, dtype)
        else:
            if self.rotation is not None:
                rows = rotate(rows, self.rotation_matrix, self.rotation).to(dtype)
            out = (torch.ops.batchrun.quant_linear(rows, self.handle, self.out_features)
                   if torch.compiler.is_compiling() else self.kernel(rows))
        if bias is not None:
            out = out + bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def _quantized_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """W8A8's int8 activations and their float32 row scale [M, 1]: per token (or by the checkpoint's static
        scale), of the rotated rows where the weight was quantized under the rotation (without rotate_quant.cpp)."""
        if self.rotation is not None:
            rows = rotate(rows, self.rotation_matrix, self.rotation)
        return fake_quantize_rows(rows, "int8", self.kernel.input_scale)


@torch.library.custom_op("batchrun::quant_linear", mutates_args=())
def quant_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return graph.lookup(handle)(x)


@quant_linear.register_fake
def _(x, handle, out_features):
    return x.new_empty(x.shape[0], out_features)


@torch.library.custom_op("batchrun::quant_product", mutates_args=())
def quant_product(qx: torch.Tensor, handle: int, out_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The int8 product of already quantized activations, without their row scale (a W8A8 kernel's product)."""
    return graph.lookup(handle).product(qx, dtype)


@quant_product.register_fake
def _(qx, handle, out_features, dtype):
    return qx.new_empty(qx.shape[0], out_features, dtype=cpu_kernels.product_dtype(dtype))


@torch.library.custom_op("batchrun::rotated_w8a8", mutates_args=())
def rotated_w8a8(x: torch.Tensor, handle: int, out_features: int, block: int) -> torch.Tensor:
    """A rotated W8A8 layer's output in x's dtype (W8A8.rotated_product)."""
    return graph.lookup(handle).rotated_product(x, block)


@rotated_w8a8.register_fake
def _(x, handle, out_features, block):
    return x.new_empty(x.shape[0], out_features)
