"""Deterministic (batch-invariant) mode for a loaded model: a row's logits are bit-identical whatever else is in its
step (other rows, chunk boundaries, a prefix-cache hit, a recompute after preemption, a resumed job).

Three things make a row's result depend on its neighbours, each fixed in its own module:
- products: the library's kernel, and its summation order, follow the row count -> every product on tiles of one
  fixed row count (models/row_tiles.py);
- attention: decode split sizes, prefill's query tiles and SDPA's blocking follow the batch, the chunk and the
  context -> every row attends as a decode of its own in one fixed order (engine/row_attention.py; the backends
  take `deterministic`);
- norms, RoPE, the activations and the sampler work row by row already (one compiled loop per row).
The same number of threads is assumed: a product's parallel split over its input dimension may follow it.
"""
from __future__ import annotations

from torch import nn


def tile_products(model: nn.Module, tile: int) -> None:
    """Every linear layer, expert and KV rotation of `model` multiplies on tiles of `tile` rows."""
    for module in model.modules():
        if hasattr(module, "row_tile"):
            module.row_tile = tile
