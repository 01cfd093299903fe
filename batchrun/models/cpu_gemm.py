"""Linear layers on the CPU through oneDNN, each weight pre-packed once at load for the blocked layout the
matrix-product kernels read; bfloat16 weights on a CPU with AMX go to batchrun's own AMX kernel instead
(kernels/amx_linear.py: about 20 % faster at a decode step's rows, up to 13 % slower at a prefill chunk's).

On an AMD EPYC (AVX2, 2 cores) oneDNN with packed weights ran SmolLM2's products faster than nn.Linear (MKL) at
every row count measured: 32 rows (a decode step) 84-102 -> 140-149 GFLOP/s, the 49152-row lm_head 37 -> 18 ms;
1024 rows (a prefill chunk) equal or better. The packed copy costs as much memory again as the weights. The ops are
the ones torch.compile's CPU freezing pass emits (torch.ops.mkldnn); where this torch lacks them, nothing is packed
and the layers run as nn.Linear (the log says which).

Every distinct row count makes a new oneDNN primitive, kept in two caches: oneDNN's primitive cache and the
primitive descriptor cache of ideep (PyTorch's oneDNN layer). Each holds 1,024 entries by default, and an entry here
costs about 280 KiB whatever the shape (a brgemm matmul descriptor), so a long job, whose steps have ever new token
counts, grew by up to 2 x 1,024 x 280 KiB (about 560 MiB) as the caches filled. Both read their capacity from the
environment on first use: it is set below, before any weight is packed (a value already set wins), to CACHE_ENTRIES,
about 70 MiB for the two. A miss costs 0.4-0.8 ms (a new primitive, AVX2 EPYC); a step reuses its shapes across
layers (and MoE experts share theirs), so its first use of a shape is the only miss. The evicted descriptors leave
free holes between a step's tensors in glibc's heap, which stay resident (glibc gives back only the heap's top):
return_freed_memory(), which the engine calls after each step, hands those pages back every TRIM_EVERY_S seconds.
"""
from __future__ import annotations

import ctypes
import logging
import os
import time

import torch

from batchrun.kernels import amx_linear
from batchrun.models import row_tiles

log = logging.getLogger("batchrun")
CACHE_ENTRIES = 128
for _knob in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):   # oneDNN's, ideep's
    os.environ.setdefault(_knob, str(CACHE_ENTRIES))
BATCH_HINT = 32          # the row count oneDNN tunes the packing for (decode steps); other counts run fine
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_unpackable: set[torch.dtype] = set()   # dtypes whose packing failed here (warned once)
TRIM_EVERY_S = 2.0       # a malloc_trim took 5-30 ms here (at most 1.5% of the time)
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)   # glibc's; elsewhere there is nothing to call
_last_trim = time.monotonic()


def return_freed_memory(now: bool = False) -> None:
    """Give the free pages inside the C heap back to the OS (glibc malloc_trim), at most every TRIM_EVERY_S
    unless `now`."""
    global _last_trim
    if _malloc_trim is not None and (now or time.monotonic() - _last_trim >= TRIM_EVERY_S):
        _malloc_trim(0)
        _last_trim = time.monotonic()


def pack(weight: torch.Tensor) -> torch.Tensor | amx_linear.PackedWeight | None:
    """The weight [out, in] packed for `linear` (the AMX kernel's layout or oneDNN's), or None where packing is not
    available here."""
    if amx_linear.packable(weight):
        return amx_linear.PackedWeight(weight)
    return pack_onednn(weight)


def pack_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] packed for oneDNN's ops, or None where packing is not available here."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
    except (AttributeError, RuntimeError) as exc:   # e.g. bf16 packing needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT
        if weight.dtype not in _unpackable:
            _unpackable.add(weight.dtype)
            log.warning("oneDNN weight packing unavailable for %s (%s); linear layers run unpacked", weight.dtype,
                        str(exc).splitlines()[0])
        return None


def linear(x: torch.Tensor, packed: torch.Tensor | amx_linear.PackedWeight, bias: torch.Tensor | None,
           row_tile: int = 0) -> torch.Tensor:
    """x [rows, in] @ packed^T (+ bias) -> [rows, out]; row_tile > 0: on tiles of that many rows (row_tiles.py)."""
    if row_tile:
        return row_tiles.tiled(lambda rows: linear(rows, packed, bias), x, row_tile)
    if isinstance(packed, amx_linear.PackedWeight):
        return amx_linear.linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
