"""A Hadamard rotation of a quantized layer's input channels, data-free (QuaRot's idea): for an orthonormal H,
x W^T = (x H)(W H)^T, so the weight is quantized as W H and each token's activations as x H. H spreads an outlier
channel over its block: the per-token int8 scale, set by the row's largest magnitude, then no longer flattens
every other channel to a few levels (SmolLM2's activations have such channels).

H is block-diagonal: a normalised Sylvester-Hadamard matrix on each block of `block` input channels, `block` the
largest power of two dividing in_features, at most MAX_BLOCK: b multiply-adds per input value, computed in float32.
The Sylvester matrix is symmetric, so H is its own inverse: (W H) H = W.
"""
from __future__ import annotations

import functools

import torch

MAX_BLOCK = 128


def block_size(in_features: int) -> int:
    return min(in_features & -in_features, MAX_BLOCK)


@functools.lru_cache(maxsize=None)
def hadamard(n: int) -> torch.Tensor:
    """The normalised Sylvester-Hadamard matrix [n, n] in float32 (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: size {n} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def rotate(x: torch.Tensor, h: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] (any float dtype) -> x H in float32, H the block-diagonal matrix of h = hadamard(block). The
    block size comes as an int: read from h inside the compiled graph it became a symbol, which inductor's code
    then lacked; and the blocks are split off the channel dimension alone, as a reshape to (-1, block) made dynamo
    guard the (dynamic) row count."""
    return (x.float().unflatten(-1, (x.shape[-1] // block, block)) @ h).flatten(-2)
