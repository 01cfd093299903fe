"""LoRA's expand on the CPU (lora_expand.cpp): out = y + each row's own adapter's (x A^T) B^T, over the runs of
rows the model runner groups by adapter, reading only that adapter's nonzero B blocks, with no per-row mask.

The oneDNN way (one product over every resident adapter's B side by side, a mask zeroing each row's other adapters'
columns) reads every adapter's B, with the zero blocks of the fused q/k/v and gate/up projections, and pays oneDNN's
fixed cost per call; this kernel does r float32 multiply-adds per output for a row's own adapter only.
"""
from __future__ import annotations

from pathlib import Path

import torch

from batchrun.kernels import cpp_build

_kernel = cpp_build.Kernel("batchrun_lora_expand",
                           [Path(__file__).with_name(name) for name in ("lora_expand.cpp", "cpu_vec.h")],
                           "LoRA expand kernel", "oneDNN's masked products")
load = _kernel.load   # the compiled module, or None (see cpp_build.load)


def flat_block(bt: torch.Tensor) -> torch.Tensor:
    """One module's B^T [r, n] in the kernel's flat layout: as it is, or for bfloat16 on a CPU with AVX512-BF16 the
    rank's pairs interleaved ([ceil(r / 2), n, 2], an odd rank padded with a zero row)."""
    if bt.dtype != torch.bfloat16 or not _kernel.module.bf16_pairs():
        return bt.flatten()
    if len(bt) % 2:
        bt = torch.cat([bt, bt.new_zeros(1, bt.shape[1])])
    return bt.view(-1, 2, bt.shape[1]).transpose(1, 2).flatten()


def expand(y: torch.Tensor, h: torch.Tensor, bt: torch.Tensor, pieces: torch.Tensor, first: torch.Tensor,
           runs: torch.Tensor) -> torch.Tensor:
    """A new contiguous y + update (the table layouts: lora_expand.cpp); call only when load() returned a module."""
    return _kernel.module.lora_expand(y, h, bt, pieces, first, runs)
