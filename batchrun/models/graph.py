"""The whole decoder forward as one torch.compile graph on the CPU (inductor, dynamic token counts).

Run op by op, a SmolLM2 step spends a good part of its time between the products: 30 layers x about a dozen calls,
each with Python, dispatch and (for the compiled elementwise pieces) guard checks. One graph per forward fuses the
elementwise work with the residual adds and runs the rest without Python in between: SmolLM2 bf16, 16 chat
prompts, one thread of an Intel Xeon (AMX): 19.4 -> 16.5 s of CPU time.

Two things inductor cannot trace become opaque custom ops that reach their state through a handle:
- `batchrun::packed_linear`: the oneDNN-packed weight is an opaque MKLDNN tensor that tracing cannot fake (a
  oneDNN-packed layer runs `batchrun_native::packed_linear` instead, its C++ twin, kernels/native_linear.py: SmolLM2
  bf16, 32 requests x 64 tokens, 12 alternating rounds in one process, median 3.46 -> 3.11 s, faster in 11);
- `batchrun::attention`: the paged KV cache and the step's attention metadata (Python objects) stay outside the
  graph; `step(segments)` makes them current for the duration of one forward.

The first forward of each shape family compiles (tens of seconds; inductor's on-disk cache makes later starts
faster). Families whose forward has data-dependent shapes (MoE routing) keep the per-op path (`CausalLM.whole_graph`).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
import weakref
from typing import Any, Optional

import torch

from batchrun.kernels import native_linear

# The code that calls the graph's kernels and ops in C++ (cpp_wrapper), not Python, and without the size, alignment
# and scalar checks inductor puts around each call: a SmolLM2 bf16 step makes about 200 such calls. 32 requests x 64
# tokens, both graphs in one process, 10 alternating rounds, AMD EPYC (2 cores): median 4.30 -> 4.02 s, faster in
# every round (runs of 6 and 8 rounds: 4.17 -> 3.71, 3.85 -> 3.80); the 0.3B Llama at int8 4.38 -> 4.26 s. The first
# start compiles about 12 s longer (71 -> 83 s with an empty inductor cache), later ones read it from the cache.
COMPILE_OPTIONS = {"cpp_wrapper": True, "size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}

_objects: dict[int, Any] = {}   # handle -> packed weight, or weak reference to an Attention module
_handles = itertools.count()
_current = threading.local()    # .segments: the step being run, set by step()


def enabled() -> bool:
    """BATCHRUN_COMPILE: 1 (default) the whole-model graph, ops: only the elementwise pieces (fused.py), 0: eager."""
    return os.environ.get("BATCHRUN_COMPILE", "1") not in ("0", "ops")


def register(owner: object, obj: Any) -> int:
    """A handle for `obj`, dropped when `owner` is garbage-collected."""
    handle = next(_handles)
    _objects[handle] = obj
    weakref.finalize(owner, _objects.pop, handle, None)
    return handle


def release(handle: int) -> None:
    """Drop the object behind `handle` before its owner goes (the owner no longer reads it), here and in
    native_linear's registry."""
    _objects.pop(handle, None)
    native_linear.release(handle)


def lookup(handle: int) -> Any:
    return _objects[handle]


@contextlib.contextmanager
def step(segments):
    """Makes `segments` (the step's attention metadata per KV pool) the ones the attention op reads."""
    _current.segments = segments
    try:
        yield
    finally:
        _current.segments = None


@torch.library.custom_op("batchrun::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, out_features: int, bias: Optional[torch.Tensor],
                  row_tile: int = 0) -> torch.Tensor:
    from batchrun.models import cpu_gemm
    return cpu_gemm.linear(x, _objects[handle], bias, row_tile)


@packed_linear.register_fake
def _(x, handle, out_features, bias, row_tile=0):
    return x.new_empty(x.shape[0], out_features)


@torch.library.custom_op("batchrun::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int) -> torch.Tensor:
    """Writes k/v to the layer's paged cache and attends (the layer's Attention.attend)."""
    return _objects[handle]().attend(q, k, v, _current.segments)


@attention.register_fake
def _(q, k, v, handle):
    return torch.empty_like(q)
