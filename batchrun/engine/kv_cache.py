"""The preallocated KV pool: one tensor for all layers' blocks, plus per-token-per-head scales when 8-bit."""
from __future__ import annotations

from typing import NamedTuple

import torch

from batchrun.kernels import quant

STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SCALE_DTYPE = torch.float32


class LayerCache(NamedTuple):
    """One layer's view of the pool: k/v [num_blocks, block_size, kv_heads, head_dim], scales [.., kv_heads]."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


def storage_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return compute_dtype
    if name in STORAGE_DTYPES:
        return STORAGE_DTYPES[name]
    return quant.storage_dtype(name)


def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x (head_dim x element bytes + scale bytes), exactly as allocated."""
    scale_bytes = SCALE_DTYPE.itemsize if quant.is_quantized(dtype) else 0
    return 2 * num_layers * kv_heads * (head_dim * dtype.itemsize + scale_bytes)


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.dtype = dtype
        self.data = torch.zeros(2, num_layers, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        self.scales = (torch.ones(2, num_layers, num_blocks, block_size, kv_heads, dtype=SCALE_DTYPE, device=device)
                       if quant.is_quantized(dtype) else None)

    def layer(self, i: int) -> LayerCache:
        if self.scales is None:
            return LayerCache(self.data[0, i], self.data[1, i], None, None)
        return LayerCache(self.data[0, i], self.data[1, i], self.scales[0, i], self.scales[1, i])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks, every layer's K and V (and scales): (source, destination) pairs."""
        src = torch.tensor([a for a, _ in pairs], device=self.data.device)
        dst = torch.tensor([b for _, b in pairs], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]
        if self.scales is not None:
            self.scales[:, :, dst] = self.scales[:, :, src]
