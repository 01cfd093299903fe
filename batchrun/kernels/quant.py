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


def rotation(head_dim: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """An orthogonal [d, d] matrix that spreads outlier channels over all channels before 8-bit storage.

    q.k = (qR).(kR) and sum p_i (v_i R) = (sum p_i v_i) R, so attention over rotated K/V with a rotated query,
    un-rotated at the end, is exact; only the quantization error shrinks. Normalised Walsh-Hadamard for powers of
    two, else a fixed-seed random orthogonal matrix.
    """
    if head_dim & (head_dim - 1) == 0:
        r = torch.ones(1, 1)
        while r.shape[0] < head_dim:
            r = torch.cat([torch.cat([r, r], 1), torch.cat([r, -r], 1)], 0)
        r = r / head_dim ** 0.5
    else:
        r, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=torch.Generator().manual_seed(0)))
    return r.to(device=device, dtype=dtype)
