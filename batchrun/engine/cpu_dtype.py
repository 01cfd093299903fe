"""The compute dtype `dtype: auto` picks on a CPU: bfloat16 where the CPU multiplies it natively and faster.

CPUs of one kind differ: without bf16 units, 16-bit matrix products ran 6-250x slower than float32 on the machines
measured; with AVX-512 BF16 (AMD EPYC) they ran 2.8-3.8x faster. So the flags are read and then confirmed by a
short timed product, once a process. BATCHRUN_CPU_DTYPE=float32|bfloat16 fixes the choice (the tests pin float32,
whose results they compare with transformers token for token).
"""
from __future__ import annotations

import functools
import os

import torch

from batchrun.cpu_timing import one_thread, seconds
from batchrun.cpuinfo import cpu_flags

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _matmul_seconds(dtype: torch.dtype, size: int = 512, reps: int = 5) -> float:
    """The best of `reps` timed size^3 products, on one thread (cpu_timing: two threads of a busy machine wait for
    each other, which can make either dtype look slow)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    with one_thread():
        torch.mm(a, b)
        return min(seconds(lambda: torch.mm(a, b)) for _ in range(reps))


@functools.cache
def auto_cpu_dtype() -> tuple[torch.dtype, str]:
    """(dtype, the reason in words, for the start-up log)."""
    forced = os.environ.get("BATCHRUN_CPU_DTYPE")
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"BATCHRUN_CPU_DTYPE: {forced!r} is not float32 or bfloat16")
        return getattr(torch, forced), f"{forced}: set by BATCHRUN_CPU_DTYPE"
    native = sorted(set(BF16_FLAGS) & cpu_flags())
    if not native:
        return torch.float32, "float32: the CPU has no native bf16 (neither avx512_bf16 nor amx_bf16)"
    bf16, fp32 = _matmul_seconds(torch.bfloat16), _matmul_seconds(torch.float32)
    if bf16 < fp32:
        return torch.bfloat16, (f"bfloat16: native bf16 ({', '.join(native)}), 512^3 product {bf16 * 1e3:.2f} ms "
                                f"vs float32 {fp32 * 1e3:.2f} ms")
    return torch.float32, (f"float32: bf16 flags ({', '.join(native)}) but the bf16 product measured slower "
                           f"({bf16 * 1e3:.2f} ms vs {fp32 * 1e3:.2f} ms)")
