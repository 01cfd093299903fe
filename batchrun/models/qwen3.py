"""Qwen3: the shared decoder with an RMSNorm over each head of q and k before RoPE."""
from __future__ import annotations

from dataclasses import replace

from batchrun.models.attention import AttentionOptions
from batchrun.models.base import CausalLM


class Qwen3ForCausalLM(CausalLM):
    def attention_options(self, layer: int) -> AttentionOptions:
        return replace(super().attention_options(layer), qk_norm="head")
