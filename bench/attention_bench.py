"""What the CPU attention benches (prefill_attention.py, shared_prefix_decode.py) share: the heads they time, the
CPU line they print first, and the dtypes at which the prefill kernel runs here."""
from __future__ import annotations

import torch

from batchrun.cpuinfo import cpu_flags, cpu_model
from batchrun.kernels import cpu_attention

SHAPES = {"smollm2": (9, 3, 64), "mid": (16, 4, 64)}   # query heads, KV heads, head_dim: SmolLM2-135M, a ~0.3B Llama
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def start(threads: int) -> None:
    """torch on `threads` threads; prints the CPU model, its flags of interest and the thread count."""
    torch.set_num_threads(threads)
    flags = " ".join(f for f in FLAGS if f in cpu_flags()) or "none of " + " ".join(FLAGS)
    print(f"{cpu_model()}; {flags}; {threads} thread(s)")


def prefill_dtypes() -> list[torch.dtype]:
    """bfloat16 and float32 where the prefill kernel runs here; prints why for each where it does not."""
    dtypes = []
    for dtype in (torch.bfloat16, torch.float32):
        probe = torch.zeros(1, 3, 64, dtype=dtype)
        if cpu_attention.prefill_supported(probe, probe):
            dtypes.append(dtype)
        else:
            print(f"{dtype}: the prefill kernel does not run here (no AVX-512 / AVX512-BF16, or no C++ toolchain)")
    return dtypes
