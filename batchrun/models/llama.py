"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over the paged KV cache.

Weights keep transformers' names, except that q/k/v and gate/up projections are fused into one
matrix each at load time (fewer, larger matrix products).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.attention_metadata import Segment
from batchrun.models import cpu_gemm, fused

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class Linear(nn.Linear):
    """nn.Linear that, once `pack_for_cpu()` has run, multiplies through oneDNN with a pre-packed weight."""

    packed: torch.Tensor | None = None

    def pack_for_cpu(self) -> bool:
        self.packed = cpu_gemm.pack(self.weight)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2:
            return cpu_gemm.linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


def rope_tables(config, head_dim: int, max_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_len, head_dim], using transformers' RoPE variants (llama3, yarn, ...)."""
    params = getattr(config, "rope_parameters", None) or {
        "rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = 1.0
    if rope_type == "default":
        inv_freq = 1.0 / params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq.float())
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(device, dtype), (emb.sin() * scaling).to(device, dtype)


class Attention(nn.Module):
    def __init__(self, config, backend):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size,
                                bias=config.model_type != "qwen2" and getattr(config, "attention_bias", False))
        self.scale = self.head_dim ** -0.5
        self.backend = backend
        self.kv_caches = []       # one LayerCache per KV pool (lane), set by the model runner
        self.kv_rotations = []    # per pool: [d, d] orthogonal matrix for int8 storage (kernels.quant.rotation)

    def forward(self, x, cos, sin, segments: list[Segment]):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = fused.apply_rope(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = fused.apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if len(segments) == 1:
            out = self._attend(q, k, v, segments[0])
        else:
            out = torch.empty_like(q)
            for seg in segments:
                rows = slice(seg.start, seg.end)
                out[rows] = self._attend(q[rows], k[rows], v[rows], seg)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _attend(self, q, k, v, seg: Segment):
        rotation = self.kv_rotations[seg.pool]
        if rotation is not None:   # attention is unchanged by the rotation; int8 storage error shrinks
            q, k, v = q @ rotation, k @ rotation, v @ rotation
        out = self.backend.forward(q, k, v, self.kv_caches[seg.pool], seg.meta, self.scale)
        return out if rotation is None else out @ rotation.T


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, backend):
        super().__init__()
        self.self_attn = Attention(config, backend)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, segments):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segments)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config, backend):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, backend):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"model: hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.config = config
        self.model = LlamaModel(config, backend)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.cos = self.sin = None

    def checkpoint_plan(self, names: list[str]) -> dict[str, tuple[str, ...]]:
        return checkpoint_plan(names, getattr(self.config, "tie_word_embeddings", False))

    def pack_for_cpu(self) -> bool:
        """Pre-pack every projection's weight for oneDNN (CPU only); False where this torch cannot."""
        return all([m.pack_for_cpu() for m in self.modules() if isinstance(m, Linear)])

    def init_rope(self, max_len: int, device, dtype) -> None:
        head_dim = self.model.layers[0].self_attn.head_dim
        self.cos, self.sin = rope_tables(self.config, head_dim, max_len, device, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Hidden states for every new token; logits only at `logits_indices` (the tokens to sample)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.cos[positions], self.sin[positions]
        for layer in self.model.layers:
            x = layer(x, cos, sin, segments)
        return self.lm_head(self.model.norm(x[logits_indices])).float()


FUSED = ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj"))


def checkpoint_plan(names: list[str], tie_embeddings: bool) -> dict[str, tuple[str, ...]]:
    """This module's tensor names -> the transformers checkpoint tensors concatenated into each (fused q/k/v and
    gate/up; one tensor for the others). A tied lm_head names the embedding's tensors, so both share one copy."""
    plan = {}
    for name in names:
        if "rotary_emb" in name:
            continue
        for parts, joined in FUSED:
            if f".{parts[0]}." in name:
                plan[name.replace(parts[0], joined)] = tuple(name.replace(parts[0], p) for p in parts)
        if not any(f".{p}." in name for parts, _ in FUSED for p in parts):
            plan[name] = (name,)
    if tie_embeddings or "lm_head.weight" not in plan:
        plan["lm_head.weight"] = plan["model.embed_tokens.weight"]
    return plan
