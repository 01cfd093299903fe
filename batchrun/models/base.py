"""The decoder-only model every family builds on: embeddings, a stack of layers, a final norm, the LM head.

A family subclasses `CausalLM` and overrides only what its math changes: `attention_options` (per layer),
`make_mlp`, `make_layer`, `embed`, `final_logits`. Weights keep the checkpoint's names, except that q/k/v and
gate/up projections are fused into one matrix each at load time (fewer, larger matrix products).
"""
from __future__ import annotations

import types

import torch
from torch import nn

from batchrun.attention_metadata import Segment
from batchrun.models import graph
from batchrun.models.attention import Attention, AttentionOptions
from batchrun.models.layers import Embedding, GatedMLP, Linear, RMSNorm, longrope_switch, rope_tables


class DecoderLayer(nn.Module):
    """Pre-norm residual block (Llama): x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config, attention: Attention, mlp: nn.Module):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, segments):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segments)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config, layers: list[nn.Module], norm: RMSNorm):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


def sliding_window(config, layer: int) -> int | None:
    """The layer's window: from `layer_types` where the config has them (Gemma, Qwen), else `sliding_window` on
    every layer (Mistral, Mixtral, Phi-3); None for full attention."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[layer] == "sliding_attention" else None
    return window


class CausalLM(nn.Module):
    qkv_bias = False      # Qwen2 has q/k/v biases whatever attention_bias says
    norm_unit_offset = False
    whole_graph = True    # the forward traces into one torch.compile graph (graph.py); False: data-dependent shapes

    def __init__(self, config, backend):
        super().__init__()
        self.config = config
        layers = [self.make_layer(i, Attention(config, backend, self.attention_options(i)), self.make_mlp(i))
                  for i in range(config.num_hidden_layers)]
        self.model = DecoderModel(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                          self.norm_unit_offset))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rope_len = 0
        self.long_rope_after = longrope_switch(config)
        self._graph = None   # the compiled forward, once compile_graph() has run

    # --- what a family may override ---
    def attention_options(self, layer: int) -> AttentionOptions:
        bias = getattr(self.config, "attention_bias", False)
        return AttentionOptions(window=sliding_window(self.config, layer), qkv_bias=self.qkv_bias or bias,
                                o_bias=bias)

    def make_mlp(self, layer: int) -> nn.Module:
        return GatedMLP(self.config)

    def make_layer(self, layer: int, attention: Attention, mlp: nn.Module) -> nn.Module:
        return DecoderLayer(self.config, attention, mlp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def final_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).float()

    def checkpoint_plan(self, names: list[str]) -> dict[str, tuple[str, ...]]:
        return checkpoint_plan(names, getattr(self.config, "tie_word_embeddings", False))

    # --- shared ---
    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def pack_for_cpu(self) -> bool:
        """Pre-pack every projection's weight for oneDNN (CPU only), keeping one copy of each: the dense weight is
        dropped except where another module reads it (a tied lm_head's embedding). False where this torch cannot
        pack."""
        shared = {p.data_ptr() for m in self.modules() if not isinstance(m, Linear)
                  for p in m.parameters(recurse=False)}
        return all([m.pack_for_cpu(keep_dense=m.weight.data_ptr() in shared) for m in self.modules()
                    if isinstance(m, Linear)])

    def init_rope(self, max_len: int, device, dtype) -> None:
        self.rope_len = max_len
        for key in {layer.self_attn.options.rope for layer in self.model.layers}:
            self.rope[key] = rope_tables(self.config, max_len, device, dtype, key)

    def rope_offset(self, num_tokens: int) -> int:
        """Added to the positions of a request of `num_tokens` tokens: LongRoPE's long rows follow the short ones."""
        return self.rope_len if self.long_rope_after is not None and num_tokens > self.long_rope_after else 0

    def must_recompute(self, num_computed: int, num_tokens: int) -> bool:
        """True when a request grows past LongRoPE's original context with keys cached on the short factors (it
        was prefilled within that context and decodes its first token beyond): the runner then recomputes it from
        its first token, as transformers drops its cache at that point. A prompt longer than the context runs on
        the long factors from its first chunk."""
        return self.long_rope_after is not None and num_computed == self.long_rope_after == num_tokens - 1

    def compile_graph(self) -> None:
        """Run the forward as one torch.compile graph from now on (CPU; see graph.py)."""
        # Dynamo keeps compiled graphs per code object, at most recompile_limit (8) of them: every model would add
        # one to the shared _forward's and the ninth model in a process would fail. A copy of the code per model.
        fn = type(self)._forward
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        self._graph = torch.compile(types.MethodType(own, self), dynamic=True, fullgraph=True,
                                    options=graph.COMPILE_OPTIONS)

    @property
    def graph_compiled(self) -> bool:
        """True once compile_graph() has run: the graph itself is built at the first forward."""
        return self._graph is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Hidden states for every new token; logits only at `logits_indices` (the tokens to sample)."""
        if self._graph is None:
            return self._forward(input_ids, positions, segments, logits_indices)
        # Token and sample counts of 0 or 1 would otherwise each compile a specialised graph of their own.
        for t in (input_ids, positions, logits_indices):
            torch._dynamo.decorators.mark_unbacked(t, 0)
        with graph.step(segments):   # the graph's attention op reads the segments from there
            return self._graph(input_ids, positions, None, logits_indices)

    def _forward(self, input_ids, positions, segments, logits_indices):
        x = self.embed(input_ids)
        rope = {key: (cos[positions], sin[positions]) for key, (cos, sin) in self.rope.items()}
        for layer in self.model.layers:
            x = layer(x, *rope[layer.self_attn.options.rope], segments)
        return self.final_logits(x[logits_indices])


FUSED = ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj"))


def checkpoint_plan(names: list[str], tie_embeddings: bool) -> dict[str, tuple[str, ...]]:
    """Checkpoint tensor names -> this module's tensor names, each with the checkpoint tensors concatenated into
    it (fused q/k/v and gate/up; one tensor for the others). A tied lm_head names the embedding's tensors, so both
    share one copy."""
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
