"""8-bit KV storage: symmetric int8 and fp8 (e4m3), one float32 scale per token per KV head.

quantize(x [..., head_dim]) -> (codes [..., head_dim] in the storage dtype, scales [...] float32)
dequantize(codes, scales)   -> x' with |x - x'| <= scale / 2 (int8) or <= 2^-4 |x| + scale * 2^-9 (fp8)
"""
from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_MAX = 448.0           # largest finite float8_e4m3fn
TINY = 1e-12              # scale floor: an all-zero token quantizes to zeros with no 0/0

QUANTIZED_DTYPES = {"int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None)}


def storage_dtype(name: str) -> torch.dtype:
    dtype = QUANTIZED_DTYPES[name]
    if dtype is None:
        raise ValueError(f"kv_cache_dtype: 'fp8' needs torch.float8_e4m3fn, which this torch build "
                         f"({torch.__version__}) lacks; use 'int8' or a 16-bit dtype")
    return dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in (torch.int8, QUANTIZED_DTYPES["fp8"])


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    qmax = INT8_MAX if dtype == torch.int8 else FP8_MAX
    scales = (x.abs().amax(dim=-1) / qmax).clamp_min(TINY)
    scaled = x / scales[..., None]
    if dtype == torch.int8:
        return scaled.round().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scales
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(dtype), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.to(torch.float32) * scales[..., None]).to(dtype)
