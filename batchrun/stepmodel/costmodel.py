"""Step-time models. A step is described by its shape (tokens, sequences, KV read); a model turns it into seconds.

RooflineModel: time = overhead + max(bytes / (bandwidth x eff_bw), FLOPs / (peak x eff_compute)). Decode steps
read every weight once plus each sequence's KV, so they sit on the bandwidth side; prefill-heavy steps do
2 x params FLOPs per token and sit on the compute side. A mixture-of-experts model does 2 x active params FLOPs
per token and reads only the experts its tokens are routed to. The model fitted on a machine's own measured steps
(calibration, the job's ETA) is linear_fit.LinearModel.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchrun.engine.step_stats import StepShape
from batchrun.stepmodel.catalog import GPU

WEIGHT_BYTES = 2   # fp16/bf16 weights on a GPU
# Bytes per parameter of the layers' projections, by weight format: 8-bit codes (a per-output-channel scale adds
# under 0.5 %), 4-bit codes with a 16-bit scale and zero point per group of 128 (AWQ, GPTQ). Embeddings, lm_head and
# norms stay 16-bit in every format (as quantized checkpoints keep them), except with HEAD_SUFFIX.
WEIGHT_FORMATS = {"fp16": 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5 + 4 / 128}
# "int8+head": the LM head quantized at load too (engine.quantization_lm_head), a tied embedding then held as int8
# rows with a float32 scale each; formats the engine quantizes a 16-bit checkpoint's head to
HEAD_SUFFIX = "+head"
PLANNED_FORMATS = (*WEIGHT_FORMATS, *(f + HEAD_SUFFIX for f in ("int8", "fp8", "int4")))   # what --weights takes


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    tied_embeddings: bool
    attention_bias: bool = False
    num_experts: int = 0              # mixture of experts: experts per MoE layer (0: a dense model)
    experts_per_token: int = 0        # top-k
    expert_intermediate_size: int = 0
    moe_layers: int = 0               # layers whose MLP is the experts (the others are dense)
    weights: str = "fp16"             # the projections' format (WEIGHT_FORMATS)
    quantized_lm_head: bool = False   # the LM head in `weights` too (HEAD_SUFFIX)

    @classmethod
    def from_config(cls, config, name: str = "model") -> "ModelSpec":
        """From a transformers config (or a dict of its fields), without loading weights."""
        get = (config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d))
        try:
            hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
            spec = cls(name=name, num_layers=int(get("num_hidden_layers")), hidden_size=hidden, num_heads=heads,
                       kv_heads=int(get("num_key_value_heads") or heads),
                       head_dim=int(get("head_dim") or hidden // heads),
                       intermediate_size=int(get("intermediate_size")), vocab_size=int(get("vocab_size")),
                       max_context=int(get("max_position_embeddings") or 4096),
                       tied_embeddings=bool(get("tie_word_embeddings", False)),
                       attention_bias=bool(get("attention_bias", False) or get("model_type") == "qwen2"),
                       **_moe_fields(get))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"model: the config of {name!r} lacks a usable field ({exc}); needs hidden_size, "
                             f"num_attention_heads, num_hidden_layers, intermediate_size, vocab_size") from exc
        weights = checkpoint_weights(get("quantization_config"), name)
        head = weights.endswith(HEAD_SUFFIX)   # read from its own tensors: the embedding stays 16-bit, untied
        return dataclasses.replace(spec, weights=weights.removesuffix(HEAD_SUFFIX), quantized_lm_head=head,
                                   tied_embeddings=spec.tied_embeddings and not head)

    @property
    def attention_params(self) -> int:
        """One layer's attention projections and its two norms."""
        q, kv = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden_size * (q + 2 * kv) + q * self.hidden_size + ((q + 2 * kv) if self.attention_bias else 0)
        return attn + 2 * self.hidden_size

    @property
    def layer_params(self) -> int:
        """A dense layer: attention, norms and a gated MLP."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.expert_intermediate_size

    def _params(self, experts_per_moe_layer: float) -> float:
        embed = self.vocab_size * self.hidden_size
        dense = (self.num_layers - self.moe_layers) * self.layer_params
        moe = self.moe_layers * (self.attention_params + self.hidden_size * self.num_experts
                                 + experts_per_moe_layer * self.expert_params)
        return embed + dense + moe + self.hidden_size + (0 if self.tied_embeddings else embed)

    @property
    def num_params(self) -> int:
        """Total: embeddings + layers (every expert) + final norm + lm_head (unless tied to the embeddings)."""
        return int(self._params(self.num_experts))

    @property
    def active_params(self) -> int:
        """Those one token runs through: its top-k experts only (= num_params for a dense model)."""
        return int(self._params(self.experts_per_token))

    @property
    def weight_format(self) -> str:
        """The format as the planner names it: `weights`, with HEAD_SUFFIX where the LM head is quantized too."""
        return self.weights + (HEAD_SUFFIX if self.quantized_lm_head else "")

    def _table_bytes(self) -> tuple[float, float]:
        """(the embedding table, the LM head apart from it): a tied table is the head unless the head is quantized,
        and is then looked up from int8 rows (a float32 scale each)."""
        table = self.vocab_size * self.hidden_size
        if not self.quantized_lm_head:
            return table * WEIGHT_BYTES, 0 if self.tied_embeddings else table * WEIGHT_BYTES
        embed = table + 4 * self.vocab_size if self.tied_embeddings else table * WEIGHT_BYTES
        return embed, table * WEIGHT_FORMATS[self.weights]

    def _bytes(self, experts_per_moe_layer: float) -> float:
        tables = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        projections = self._params(experts_per_moe_layer) - tables - self.hidden_size
        return (projections * WEIGHT_FORMATS[self.weights] + sum(self._table_bytes())
                + self.hidden_size * WEIGHT_BYTES)

    @property
    def layer_active_params(self) -> int:
        """The active parameters a token passes through in the layers: all but the embeddings and lm_head (>= 1)."""
        embeddings = self.vocab_size * self.hidden_size
        return max(self.active_params - embeddings * (1 if self.tied_embeddings else 2), 1)

    @property
    def sequence_ratio(self) -> float:
        """A sampled sequence's lm_head row against a token's pass through the layers, in FLOPs (vocab x hidden over
        the layers' active parameters): what a decode token costs beyond a prefill token, per token's cost."""
        return self.vocab_size * self.hidden_size / self.layer_active_params

    @property
    def pair_ratio(self) -> float:
        """A prefill pair's attention FLOPs (4 x layers x heads x head_dim, as RooflineModel counts them) over a
        token's pass through the layers (2 x their active parameters)."""
        return 4 * self.num_layers * self.num_heads * self.head_dim / (2 * self.layer_active_params)

    @property
    def weight_bytes(self) -> int:
        return int(self._bytes(self.num_experts))

    def weight_bytes_read(self, tokens: int) -> float:
        """Weights a step of `tokens` tokens reads: all but the experts, and per MoE layer the experts its tokens
        are routed to (expected distinct experts under uniform routing: E x (1 - (1 - k/E)^tokens)); not an
        embedding table that is not the LM head (a step reads only its tokens' rows)."""
        embed, head = self._table_bytes()
        looked_up = embed if head else 0
        if not self.moe_layers:
            return self.weight_bytes - looked_up
        experts = self.num_experts * (1 - (1 - self.experts_per_token / self.num_experts) ** max(tokens, 1))
        return self._bytes(experts) - looked_up

    def activation_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Estimated peak of the largest step besides weights: hidden states and MLP of every token (fp16),
        float32 logits of every sampled sequence. A rough stand-in for the engine's profiled peak."""
        per_token = (4 * self.hidden_size + 2 * self.intermediate_size) * WEIGHT_BYTES
        return max_num_batched_tokens * per_token + max_num_seqs * self.vocab_size * 4


def checkpoint_weights(quantization_config, name: str = "model") -> str:
    """The weight format (WEIGHT_FORMATS, with HEAD_SUFFIX where it quantizes the LM head too) a checkpoint's
    quantization_config declares, read as the engine reads it (quant.formats); fp16 without one. A format the
    engine does not run is named, with how to plan it anyway."""
    if not quantization_config:
        return "fp16"
    from batchrun.quant.formats import checkpoint_scheme, declares_lm_head   # imports torch: quantized only
    qc = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    try:
        return checkpoint_scheme(qc).weights + (HEAD_SUFFIX if declares_lm_head(qc) else "")
    except ValueError as exc:
        raise ValueError(f"{exc} ({name!r}); pass --weights {'|'.join(WEIGHT_FORMATS)} to plan it as one of "
                         f"those") from None


def _moe_fields(get) -> dict:
    """Mixture-of-experts sizes from a config (Mixtral: num_local_experts on every layer; Qwen3-MoE: num_experts,
    moe_intermediate_size, on the layers decoder_sparse_step selects outside mlp_only_layers)."""
    experts = int(get("num_local_experts") or get("num_experts") or 0)
    if not experts:
        return {}
    layers = int(get("num_hidden_layers"))
    step, dense = int(get("decoder_sparse_step") or 1), set(get("mlp_only_layers") or [])
    moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, experts_per_token=int(get("num_experts_per_tok")),
                expert_intermediate_size=int(get("moe_intermediate_size") or get("intermediate_size")),
                moe_layers=moe_layers)


def kv_share(kv_heads: int, tp: int) -> float:
    """The fraction of a token's KV one of `tp` ranks holds: its KV heads (one, replicated, when tp > kv_heads)."""
    return max(1, kv_heads // tp) / kv_heads


@dataclass
class RooflineModel:
    """One step of one replica. Under tensor parallelism (tp ranks) each GPU reads 1/tp of the weights and its KV
    heads' share of the KV, does 1/tp of the FLOPs, and the ranks then wait for the all-reduces (not overlapped,
    as in vLLM's default path)."""
    model: ModelSpec
    gpu: GPU
    kv_bytes_per_token: int      # the whole model's (every KV head)
    eff_bandwidth: float = 0.8
    eff_compute: float = 0.6
    overhead_s: float = 0.0015   # scheduler, launches, sampling: per step
    tp: int = 1
    eff_interconnect: float = 0.7
    collective_latency_s: float = 8e-6   # per all-reduce: launch and ring hops (NCCL, one node)

    def parts(self, s: StepShape) -> tuple[float, float]:
        """(memory seconds, compute seconds) of one step, on one GPU of the replica."""
        m = self.model
        kv = (s.kv_bytes or s.kv_tokens * self.kv_bytes_per_token) * kv_share(m.kv_heads, self.tp)
        read = m.weight_bytes_read(s.tokens) / self.tp + kv
        matmul = 2 * (m.active_params - m.vocab_size * m.hidden_size * (1 if m.tied_embeddings else 2)) * s.tokens
        lm_head = 2 * m.vocab_size * m.hidden_size * s.seqs
        attention = 4 * m.num_layers * m.num_heads * m.head_dim * s.attn_pairs
        return (read / (self.gpu.bandwidth_gbs * 1e9 * self.eff_bandwidth),
                (matmul + lm_head + attention) / self.tp / (self.gpu.fp16_tflops * 1e12 * self.eff_compute))

    def allreduce_time(self, s: StepShape) -> float:
        """Two all-reduces per layer (after o_proj and down_proj) and one after the embedding, of every token's
        hidden state (16-bit), by ring (each GPU sends and receives 2 (tp - 1) / tp of the bytes), plus the gather
        of the sampled rows' float32 logits on rank 0."""
        if self.tp == 1:
            return 0.0
        m, ring = self.model, 2 * (self.tp - 1) / self.tp
        count = 2 * m.num_layers + 1
        hidden = count * ring * s.tokens * m.hidden_size * WEIGHT_BYTES
        moved = hidden + (self.tp - 1) / self.tp * s.seqs * m.vocab_size * 4
        return moved / (self.gpu.allreduce_gbs * 1e9 * self.eff_interconnect) + (count + 1) * self.collective_latency_s

    def step_time(self, s: StepShape) -> float:
        return self.overhead_s + max(self.parts(s)) + self.allreduce_time(s)

    def decode_step(self, batch: int, context: int) -> float:
        return self.step_time(StepShape(batch, batch, batch * context, batch * context))

    def prefill_step(self, tokens: int) -> float:
        return self.step_time(StepShape(tokens, 1, tokens, tokens * (tokens + 1) // 2))
