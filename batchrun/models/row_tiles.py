"""Batch-invariant linear layers (deterministic mode): every product runs on tiles of one fixed row count.

A matrix-product library picks its kernel, and with it the order in which it sums over the input dimension, by the
shape: oneDNN on an Intel Xeon (AMX) gave a bf16 row of the 576 -> 49152 lm_head one result in products of 1-32
rows and another in products of 33-256 rows. At 16 bits that last-bit difference can change a greedy token, so a
row's output depended on how many rows shared its step. Here every product is split into tiles of exactly `tile`
rows (the last one padded with zeros): each tile is the same call with the same shape, so a row's result depends
only on the row, not on its neighbours, their number or its place in the tile (tests/test_deterministic.py checks
all of these). The cost is the tiles' lost efficiency on large steps and the padding on small ones (README).
"""
from __future__ import annotations

from typing import Callable

import torch

DEFAULT_TILE = 64   # rows per product in deterministic mode (chosen by bench/deterministic_cost.py, see README)


def tiled(product: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, tile: int) -> torch.Tensor:
    """product(rows) computed tile by tile: rows [M, in] -> [M, out], every call on exactly `tile` rows."""
    count = rows.shape[0]
    if count == 0:
        return product(rows)
    outs = []
    for start in range(0, count, tile):
        part = rows[start:start + tile]
        if part.shape[0] < tile:
            part = torch.cat([part, part.new_zeros(tile - part.shape[0], part.shape[1])])
        outs.append(product(part))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:count]
