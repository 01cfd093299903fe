"""Families that are the shared decoder as it is: Llama (SmolLM2), Mistral (sliding window on every layer),
Qwen2 (q/k/v biases, sliding window on the layers `layer_types` names) and Phi-3/Phi-4-mini (fused qkv and
gate_up in the checkpoint, partial rotary and LongRoPE through the shared RoPE tables)."""
from __future__ import annotations

from batchrun.models.base import CausalLM


class LlamaForCausalLM(CausalLM):
    pass


class Qwen2ForCausalLM(CausalLM):
    qkv_bias = True
