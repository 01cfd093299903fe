"""The canonical form of one quantized linear weight, whatever the checkpoint format or the device: the loaders
(load-time quantization, compressed-tensors, AWQ, GPTQ) produce it, the kernels (CPU packing, CUDA dequant-GEMM)
read it.

  int8  data int8 [N, K], scale float32 [N]:             w = data * scale[:, None]
  fp8   data float8_e4m3fn [N, K], scale float32 [N]:    w = data.float() * scale[:, None]
  int4  data uint8 [N, K // 2] (low nibble = even k, high nibble = odd k, values 0..15), scale and zeros float32
        [N, K // G]:                                      w = (q - zeros) * scale, per group of G input channels

`activations` says what the input goes through first: "none" (weight-only, W8A16 / W4A16), "int8" or "fp8"
(W8A8: quantized per token, dynamically, or with the checkpoint's static per-tensor `input_scale`).
`input_perm` (GPTQ act-order): the input's columns are gathered by it first, so the groups are contiguous.
`rotation` (load-time quantization): the block size of the Hadamard rotation the weight was quantized under
(rotation.py): data holds W H, and the input is rotated the same way before the product.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from batchrun.quant.rotation import hadamard, rotate

KINDS = ("int8", "fp8", "int4")
FP8_MAX = 448.0   # largest finite float8_e4m3fn
ACTIVATIONS = ("none", "int8", "fp8")


@dataclass
class QuantizedWeight:
    kind: str
    data: torch.Tensor
    scale: torch.Tensor
    zeros: torch.Tensor | None = None
    group_size: int | None = None
    activations: str = "none"
    input_scale: torch.Tensor | None = None   # static per-tensor activation scale (W8A8 checkpoints), else dynamic
    input_perm: torch.Tensor | None = None
    rotation: int | None = None

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        return self.data.shape[1] * (2 if self.kind == "int4" else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zeros, self.input_perm)
                   if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] as floats, in the checkpoint's column order (the reference every kernel matches)."""
        if self.kind == "int4":
            q = unpack_int4(self.data).float()
            g = self.group_size
            w = (q - self.zeros.repeat_interleave(g, 1)) * self.scale.repeat_interleave(g, 1)
            if self.input_perm is not None:   # column j holds the checkpoint's column input_perm[j]
                w = torch.empty_like(w).index_copy_(1, self.input_perm, w)
        else:
            w = self.data.float() * self.scale.float()[:, None]
        if self.rotation:   # data holds W H; H is its own inverse
            w = rotate(w, hadamard(self.rotation), self.rotation)
        return w.to(dtype)

    def to(self, device) -> "QuantizedWeight":
        move = (lambda t: None if t is None else t.to(device))
        return replace(self, data=move(self.data), scale=move(self.scale), zeros=move(self.zeros),
                       input_scale=move(self.input_scale), input_perm=move(self.input_perm))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> uint8 [N, K // 2], low nibble the even column."""
    q = q.to(torch.uint8)
    return q[:, ::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 [N, K] values 0..15."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def concat(parts: list[QuantizedWeight], name: str) -> QuantizedWeight:
    """Fused projections (q/k/v, gate/up) stacked along the output dimension; they must share a scheme."""
    first = parts[0]
    for part in parts[1:]:
        if ((part.kind, part.group_size, part.activations, part.rotation)
                != (first.kind, first.group_size, first.activations, first.rotation)):
            raise ValueError(f"model: the projections fused into {name} are quantized differently "
                             f"({first.kind}/{first.activations} vs {part.kind}/{part.activations})")
    if len(parts) == 1:
        return first
    cat = (lambda ts: None if ts[0] is None else torch.cat(ts))
    input_scale = None
    if first.input_scale is not None:   # one static scale for the shared input: the largest keeps all in range
        input_scale = torch.stack([p.input_scale.reshape(()) for p in parts]).max()
    return replace(first, data=cat([p.data for p in parts]), scale=cat([p.scale for p in parts]),
                   zeros=cat([p.zeros for p in parts]), input_scale=input_scale)
