"""Which orientation of a small-batch matrix product the CPU's BLAS runs faster, probed once a process.

A decode step multiplies a few dozen token rows by every weight matrix. With MKL on an AMD EPYC (AVX2), computing
`W @ x^T` and transposing the small result back ran 10-40 % faster than nn.Linear's `x @ W^T` for SmolLM2's shapes
at 16-64 rows (the 49152-row lm_head: 38 -> 28 ms at 32 rows); at prefill sizes the two are equal. Other CPUs and
BLAS builds may differ, so a short timed probe at the model's first small product decides, and the log says which.
"""
from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F

log = logging.getLogger("batchrun")
SMALL_M = 32   # token rows up to which the probed orientation is used (decode steps)


def linear_transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x^T)^T."""
    out = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())
    return out.t().contiguous()


def _best_of(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def transposed_faster(rows: int = SMALL_M, in_features: int = 1024, out_features: int = 4096) -> bool:
    """Time both orientations on a model-sized float32 product (about 20 ms in all)."""
    x, weight = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    plain = _best_of(lambda: F.linear(x, weight))
    transposed = _best_of(lambda: linear_transposed(x, weight, None))
    faster = transposed < 0.95 * plain
    log.info("CPU small-batch products: %s (x @ W^T %.2f ms, W @ x^T %.2f ms at %dx%dx%d)",
             "W @ x^T" if faster else "x @ W^T", plain * 1e3, transposed * 1e3, rows, in_features, out_features)
    return faster
