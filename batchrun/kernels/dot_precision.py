"""The `input_precision` every Triton kernel here passes to tl.dot, from its operands' dtype."""
from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """ieee for float32 operands (tl.dot would otherwise round them to tf32); tf32 is ignored for 16-bit ones."""
    return "ieee" if dtype == torch.float32 else "tf32"
