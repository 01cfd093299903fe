"""Quantize a float weight [N, K] at load, with no calibration data: symmetric per-output-channel scales for int8
and fp8 (the channel's largest magnitude maps to the format's largest value), asymmetric min/max per group of
input channels for int4. Computed in float32, one tensor at a time (the loader never holds the float model)."""
from __future__ import annotations

import torch

from batchrun.quant.rotation import block_size, hadamard, rotate
from batchrun.quant.weights import FP8_MAX, QuantizedWeight, pack_int4


def _channel_absmax(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax(dim=1).clamp_min(1e-12)


def _rotated(weight: torch.Tensor, rotate_input: bool) -> tuple[torch.Tensor, int | None]:
    """The float32 weight, as W H when its input is to be rotated (rotation.py), and the rotation's block size."""
    if not rotate_input:
        return weight.float(), None
    block = block_size(weight.shape[1])
    return rotate(weight, hadamard(block), block), block


def int8_per_channel(weight: torch.Tensor, activations: str = "none", rotate_input: bool = False
                     ) -> QuantizedWeight:
    w, block = _rotated(weight, rotate_input)
    scale = _channel_absmax(w) / 127.0
    data = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", data, scale, activations=activations, rotation=block)


def fp8_per_channel(weight: torch.Tensor, activations: str = "fp8", rotate_input: bool = False) -> QuantizedWeight:
    w, block = _rotated(weight, rotate_input)
    scale = _channel_absmax(w) / FP8_MAX
    data = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", data, scale, activations=activations, rotation=block)


INT4_GROUP_SIZES = (128, 64, 32)   # the first that divides in_features (SmolLM2's 576 takes 64)


def int4_grouped(weight: torch.Tensor, group_size: int | None = None, rotate_input: bool = False
                 ) -> QuantizedWeight:
    """Asymmetric 4-bit per group of `group_size` input channels: q = round(w / scale) + zero in 0..15."""
    n, k = weight.shape
    group_size = group_size or next((g for g in INT4_GROUP_SIZES if k % g == 0), INT4_GROUP_SIZES[0])
    if k % group_size:
        raise ValueError(f"int4: in_features {k} is not a multiple of the group size {group_size}")
    w, block = _rotated(weight, rotate_input)
    w = w.reshape(n, k // group_size, group_size)
    low, high = w.amin(-1).clamp_max(0), w.amax(-1).clamp_min(0)
    scale = ((high - low) / 15).clamp_min(1e-12)
    zeros = torch.round(-low / scale).clamp_(0, 15)
    q = torch.round(w / scale[..., None] + zeros[..., None]).clamp_(0, 15).reshape(n, k)
    return QuantizedWeight("int4", pack_int4(q), scale, zeros, group_size, rotation=block)


def fake_quantize_rows(x: torch.Tensor, kind: str, static_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (quantized x, float32 scale [M, 1]): per token (row), symmetric, or the static per-tensor scale."""
    xf = x.float()
    top = 127.0 if kind == "int8" else FP8_MAX
    scale = (static_scale.float().reshape(1, 1).expand(x.shape[0], 1) if static_scale is not None
             else xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / top)
    if kind == "int8":
        return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
