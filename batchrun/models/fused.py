"""The decoder's elementwise pieces (RMSNorm, SiLU/GELU-and-multiply, RoPE), fused into single loops on the CPU by
torch.compile (inductor, dynamic token counts, so a step of any size reuses one compiled kernel).

Eager, each piece is several passes over [tokens, hidden] tensors; fused, one. On an AMD EPYC (2 cores) two
SmolLM2 prefill steps of 1,024 tokens ran 6.0-6.3 s eager and 4.4-4.6 s fused. The first use compiles (about 25 s on
2 cores; inductor's on-disk cache makes later starts faster). Inside the whole-model graph (graph.py, the CPU default)
they are traced as plain torch instead. BATCHRUN_COMPILE=ops compiles only these pieces, BATCHRUN_COMPILE=0 keeps
everything eager; CUDA tensors always run eager here.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

ENABLED = os.environ.get("BATCHRUN_COMPILE", "1") != "0"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers does: normalise in float32, scale in the input dtype.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, r] (rotate-half convention, as transformers' Llama) over the first r <= d
    dimensions; the rest pass through (partial rotary)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = rot // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _on_cpu(eager):
    compiled = torch.compile(eager, dynamic=True)

    def run(x: torch.Tensor, *args):
        if torch.compiler.is_compiling():   # traced into a whole-model graph (graph.py), which fuses it there
            return eager(x, *args)
        return compiled(x, *args) if ENABLED and x.device.type == "cpu" else eager(x, *args)
    run.__doc__ = eager.__doc__
    run.eager = eager   # for many small calls, where the compiled call's guards cost more than they save
    return run


rms_norm = _on_cpu(_rms_norm)
silu_and_mul = _on_cpu(_silu_and_mul)
gelu_tanh_and_mul = _on_cpu(_gelu_tanh_and_mul)
apply_rope = _on_cpu(_rope)
