"""OLMo 2: norms after attention and after the MLP (none before), and q/k RMSNorm over the whole projection."""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from batchrun.models.attention import Attention, AttentionOptions
from batchrun.models.base import CausalLM
from batchrun.models.layers import RMSNorm


class PostNormLayer(nn.Module):
    """x + norm(attn(x)), then x + norm(mlp(x))."""

    def __init__(self, config, attention: Attention, mlp: nn.Module):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, segments):
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, segments))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(CausalLM):
    def attention_options(self, layer: int) -> AttentionOptions:
        return replace(super().attention_options(layer), qk_norm="full")

    def make_layer(self, layer: int, attention: Attention, mlp: nn.Module) -> nn.Module:
        return PostNormLayer(self.config, attention, mlp)
