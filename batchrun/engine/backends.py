"""Attention backend selection, beside the backends (neither backend module imports the other)."""
from __future__ import annotations

import torch

from batchrun.engine.attention import TorchAttentionBackend


def get_backend(name: str, device: torch.device, deterministic: bool = False):
    """auto: triton on CUDA, torch elsewhere; "triton" on CPU runs only under TRITON_INTERPRET=1 (tests).
    deterministic: every query row attends as a decode of its own (engine/row_attention.py)."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from batchrun.engine.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(device, deterministic)
    if name in ("auto", "torch"):
        return TorchAttentionBackend(device, deterministic)
    raise ValueError(f"attention_backend: {name!r} is not available; allowed: auto, torch, triton")
