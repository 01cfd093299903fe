"""Building blocks shared by every model family: linear layers, RMSNorm, RoPE tables, the gated MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.kernels import native_linear
from batchrun.models import cpu_gemm, fused, graph, row_tiles


class Linear(nn.Linear):
    """nn.Linear that, once `pack_for_cpu()` has run, multiplies through oneDNN with a pre-packed weight (inside a
    whole-model graph through an opaque op that finds the packed weight by handle, see graph.py)."""

    packed: torch.Tensor | None = None
    handle: int | None = None
    native = False      # whether the packed weight is a oneDNN tensor that native_linear's C++ operator finds
    row_tile: int = 0   # > 0: deterministic mode, every product on tiles of this many rows (row_tiles.py)
    quantized = None   # a batchrun.quant.linear.QuantizedLinear where the loader quantized this layer

    def pack_for_cpu(self, keep_dense: bool = False) -> bool:
        """Pack the weight; unless `keep_dense` (another module reads the same tensor, as a tied embedding does),
        drop the dense copy: the packed one is then the only copy (the weight becomes an empty tensor of its
        dtype)."""
        if self.quantized is not None:   # its kernel packed it at load
            return True
        self.packed = cpu_gemm.pack(self.weight)
        if self.packed is None:
            return False
        self.handle = graph.register(self, self.packed)
        self.native = isinstance(self.packed, torch.Tensor) and native_linear.register(self, self.handle, self.packed)
        if not keep_dense:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x, self.bias)
        # Packed or not by the handle: a traced graph that read the packed tensor itself would guard its sizes on
        # every call (SmolLM2: 242 of its 316 Python guards; the guard check went 1.27 -> 0.85 ms a step without them).
        packed = self.handle is not None
        if not packed and not self.row_tile:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        if not packed:
            out = row_tiles.tiled(lambda tile: F.linear(tile, self.weight, self.bias), rows, self.row_tile)
        elif self.native and not self.row_tile:
            out = torch.ops.batchrun_native.packed_linear(rows, self.handle, self.out_features, self.bias)
        elif torch.compiler.is_compiling():
            out = torch.ops.batchrun.packed_linear(rows, self.handle, self.out_features, self.bias, self.row_tile)
        else:
            out = cpu_gemm.linear(rows, self.packed, self.bias, self.row_tile)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


class Embedding(nn.Embedding):
    """nn.Embedding whose table the loader may hold as int8 codes with a float32 scale per row instead (a table
    tied to a quantized LM head, quant/load.py): the rows looked up are widened to the weight's dtype."""

    codes: torch.Tensor | None = None       # int8 [vocab, hidden]
    row_scale: torch.Tensor | None = None   # float32 [vocab]

    def hold_int8(self, codes: torch.Tensor, row_scale: torch.Tensor, dtype: torch.dtype) -> None:
        """Hold the table as codes from now on; the weight becomes an empty tensor of the compute dtype."""
        self.codes, self.row_scale = codes, row_scale
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=codes.device), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.codes is None:
            return super().forward(input_ids)
        return (self.codes[input_ids].float() * self.row_scale[input_ids, None]).to(self.weight.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension. `unit_offset`: the stored weight w scales by (1 + w), Gemma's convention,
    computed in float32 before casting back as Gemma does."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            return fused.rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)
        return fused.rms_norm(x, self.weight, self.eps)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The RoPE settings of one layer type: Gemma 3 keeps one dict per layer type, the others one flat dict."""
    params = getattr(config, "rope_parameters", None) or {
        "rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    return params[layer_type] if layer_type in params else params


def longrope_switch(config) -> int | None:
    """LongRoPE's original context: a sequence longer than this runs on the long factors at every position (its
    cached keys are recomputed when it grows past it, as transformers does); None for other RoPE types."""
    params = rope_parameters(config)
    return params.get("original_max_position_embeddings") if params.get("rope_type") == "longrope" else None


def rope_tables(config, max_len: int, device, dtype, layer_type: str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_len, rotary_dim] with transformers' RoPE variants (llama3, yarn, ...); rotary_dim <
    head_dim under a partial_rotary_factor. LongRoPE: [2 * max_len, rotary_dim], the short factors' rows, then the
    long factors' rows (see `longrope_switch`)."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    nested = layer_type if layer_type in (getattr(config, "rope_parameters", None) or {}) else None
    positions = torch.arange(max_len, dtype=torch.float32)
    if rope_type == "default":
        dim = int(head_dim_of(config) * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        freqs, scaling = torch.outer(positions, inv_freq), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        init = ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, scaling = init(config, "cpu", layer_type=nested)
        freqs = torch.outer(positions, inv_freq.float())
        if rope_type == "longrope":
            long_inv_freq, _ = init(config, "cpu", seq_len=params["original_max_position_embeddings"] + 1,
                                    layer_type=nested)
            freqs = torch.cat([freqs, torch.outer(positions, long_inv_freq.float())])
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(device, dtype), (emb.sin() * scaling).to(device, dtype)


ACTIVATIONS = {"silu": fused.silu_and_mul, "gelu_pytorch_tanh": fused.gelu_tanh_and_mul}


def activation(config) -> str:
    """The gated MLP's activation name (Gemma calls the field hidden_activation); refuses others by name."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name not in ACTIVATIONS:
        raise ValueError(f"model: hidden activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return name


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up as one fused matrix (`gate_up_proj`)."""

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * size, bias=bias)
        self.down_proj = Linear(size, config.hidden_size, bias=bias)
        self.act_and_mul = ACTIVATIONS[activation(config)]

    def forward(self, x):
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
