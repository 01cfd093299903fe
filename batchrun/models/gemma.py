"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), GeGLU, norms before and after attention and the
MLP with the (1 + w) weight convention, query scale from query_pre_attn_scalar, sliding and global layers as
`layer_types` says, final-logit soft-capping. Gemma 2 soft-caps attention logits; Gemma 3 does not (transformers
ignores the field there) but normalises q and k per head and keeps one RoPE table per layer type."""
from __future__ import annotations

import torch
from torch import nn

from batchrun.models.attention import Attention, AttentionOptions
from batchrun.models.base import CausalLM, sliding_window
from batchrun.models.layers import RMSNorm


class SandwichLayer(nn.Module):
    """x + post_norm(attn(pre_norm(x))), then x + post_norm(mlp(pre_norm(x)))."""

    def __init__(self, config, attention: Attention, mlp: nn.Module):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)   # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x, cos, sin, segments):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, segments))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(CausalLM):
    norm_unit_offset = True

    def attention_options(self, layer: int) -> AttentionOptions:
        config = self.config
        bias = getattr(config, "attention_bias", False)
        return AttentionOptions(window=sliding_window(config, layer), scale=config.query_pre_attn_scalar ** -0.5,
                                softcap=config.attn_logit_softcapping, qkv_bias=bias, o_bias=bias)

    def make_layer(self, layer: int, attention: Attention, mlp: nn.Module) -> nn.Module:
        return SandwichLayer(self.config, attention, mlp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # The scale is rounded to the weights' dtype first, as transformers does (sqrt(3072) is 55.5 in bf16).
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)

    def final_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().final_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3TextForCausalLM(Gemma2ForCausalLM):
    def attention_options(self, layer: int) -> AttentionOptions:
        config = self.config
        bias = getattr(config, "attention_bias", False)
        return AttentionOptions(window=sliding_window(config, layer), scale=config.query_pre_attn_scalar ** -0.5,
                                qk_norm="head", norm_unit_offset=True, qkv_bias=bias, o_bias=bias,
                                rope=config.layer_types[layer])
