"""Quantized checkpoints written the way their tools write them (safetensors directly, from the formats'
documentation; no llm-compressor / AutoAWQ / GPTQ install), each with the dequantized weights a transformers
reference runs on. Quantization here is written out independently of batchrun/quant."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from conftest import save_tiny_model, tiny_tokenizer

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
STATIC_INPUT_SCALE = 0.03
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # packed nibble i holds column 8 c + AWQ_ORDER[i] (AutoAWQ's GEMM packing)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_rows(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, C] of 0..15 -> int32 [R, C / 8]: word c holds column 8 c + order[i] at bits 4 i."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        words |= values[:, col::8].long() << (4 * i)
    return to_int32(words)


def int4_groups(w: torch.Tensor, group: int, sym: bool):
    """w [N, K] -> q [N, K] in 0..15, scale and zero [N, K / G] (zero 8 when symmetric), per group of columns."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    if sym:
        scale = g.abs().amax(-1) / 7
        zero = torch.full_like(scale, 8.0)
    else:
        low, high = g.amin(-1).clamp_max(0), g.amax(-1).clamp_min(0)
        scale = (high - low) / 15
        zero = torch.round(-low / scale)
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15).reshape(n, k)
    return q, scale, zero


def quantize_layer(fmt: str, w: torch.Tensor, opts: dict, gen: torch.Generator):
    """(checkpoint tensors by suffix, dequantized weight [N, K])."""
    n, k = w.shape
    if fmt in ("ct-fp8", "ct-int8"):
        top, dtype = (448.0, torch.float8_e4m3fn) if fmt == "ct-fp8" else (127.0, torch.int8)
        amax = w.abs().amax() if opts["strategy"] == "tensor" else w.abs().amax(1, keepdim=True)
        scale = (amax / top).to(torch.bfloat16).float().reshape(-1, 1) if opts["strategy"] == "channel" else \
            (amax / top).to(torch.bfloat16).float().reshape(1)
        scaled = w / (scale if opts["strategy"] == "channel" else scale.reshape(()))
        data = scaled.clamp(-top, top).to(dtype) if fmt == "ct-fp8" else torch.round(scaled).clamp(-127, 127).to(dtype)
        deq = data.float() * (scale if opts["strategy"] == "channel" else scale.reshape(()))
        tensors = {"weight_scale": scale.to(torch.bfloat16)}
        if opts.get("packed"):
            tensors["weight_packed"] = pack_rows_bytes(data)
            tensors["weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
        else:
            tensors["weight"] = data
        if opts.get("static"):
            tensors["input_scale"] = torch.tensor([STATIC_INPUT_SCALE])   # one for all: fused q/k/v share theirs
        return tensors, deq
    if fmt == "ct-int4":
        q, scale, zero = int4_groups(w, opts["group"], sym=True)
        scale = scale.half()
        deq = (q - zero.repeat_interleave(opts["group"], 1)) * scale.float().repeat_interleave(opts["group"], 1)
        return ({"weight_packed": pack_rows(q), "weight_shape": torch.tensor([n, k], dtype=torch.int32),
                 "weight_scale": scale}, deq)
    if fmt == "awq":
        q, scale, zero = int4_groups(w, opts["group"], sym=False)
        scale = scale.half()
        deq = (q - zero.repeat_interleave(opts["group"], 1)) * scale.float().repeat_interleave(opts["group"], 1)
        return ({"qweight": pack_rows(q.t(), AWQ_ORDER), "qzeros": pack_rows(zero.t(), AWQ_ORDER),
                 "scales": scale.t().contiguous()}, deq)
    if fmt == "gptq":
        group = opts["group"]
        perm = torch.randperm(k, generator=gen) if opts.get("act_order") else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).int()    # the i-th channel in processing order joins group i // G
        q, scale, zero = int4_groups(w[:, perm], group, sym=opts["sym"])   # groups over the processing order
        q_ck = torch.empty_like(q).index_copy_(1, perm, q)                 # back to checkpoint column order
        scale = scale.half()
        deq = (q_ck - zero[:, g_idx.long()]) * scale.float()[:, g_idx.long()]
        stored_zero = zero - 1   # checkpoint_format gptq stores zero points minus one
        return ({"qweight": pack_cols(q_ck.t()),
                 "qzeros": pack_rows(stored_zero.t()), "scales": scale.t().contiguous(), "g_idx": g_idx}, deq)
    raise AssertionError(fmt)


def pack_cols(values: torch.Tensor) -> torch.Tensor:
    """[K, N] of 0..15 -> int32 [K / 8, N]: row r holds input channels 8 r .. 8 r + 7, the first at the low bits."""
    words = torch.zeros(values.shape[0] // 8, values.shape[1], dtype=torch.int64)
    for i in range(8):
        words |= values[i::8].long() << (4 * i)
    return to_int32(words)


def pack_rows_bytes(data: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> compressed-tensors pack-quantized 8-bit: value + 128, four to an int32, the first low."""
    unsigned = (data.long() + 128)
    words = torch.zeros(data.shape[0], data.shape[1] // 4, dtype=torch.int64)
    for i in range(4):
        words |= unsigned[:, i::4] << (8 * i)
    return to_int32(words)


def ct_config(fmt: str, opts: dict) -> dict:
    if fmt == "ct-int4":
        weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": opts["group"], "symmetric": True,
                   "dynamic": False}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}}
    kind = "float" if fmt == "ct-fp8" else "int"
    weights = {"num_bits": 8, "type": kind, "strategy": opts["strategy"], "symmetric": True, "dynamic": False}
    acts = None
    if opts.get("activations"):
        acts = ({"num_bits": 8, "type": kind, "strategy": "tensor", "symmetric": True, "dynamic": False}
                if opts.get("static") else
                {"num_bits": 8, "type": kind, "strategy": "token", "symmetric": True, "dynamic": True})
    layout = "pack-quantized" if opts.get("packed") else "float-quantized" if kind == "float" else "int-quantized"
    return {"quant_method": "compressed-tensors", "format": layout, "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def write_quantized(path: Path, fmt: str, seed: int = 0, head: bool = False, tie: bool = False, **opts):
    """Save a tiny Llama quantized in `fmt` to `path` (`head`: its LM head too, as compressed-tensors without
    lm_head in `ignore` or GPTQ's `lm_head: true` declare it; `tie`: the config ties the embeddings, with `head`
    only); returns (reference transformers model on the dequantized weights, {hf layer name: dequantized weight},
    {hf layer name: static input scale})."""
    model = save_tiny_model(path, seed=seed, tie_word_embeddings=tie)
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    deq_state, dequantized, input_scales = dict(state), {}, {}
    prefixes = [f"model.layers.{layer}.{proj}" for layer in range(model.config.num_hidden_layers)
                for proj in PROJECTIONS] + (["lm_head"] if head else [])
    for prefix in prefixes:
        tensors, deq = quantize_layer(fmt, state.pop(f"{prefix}.weight"), opts, gen)
        state.update({f"{prefix}.{suffix}": t for suffix, t in tensors.items()})
        deq_state[f"{prefix}.weight"] = deq
        dequantized[prefix] = deq
        if "input_scale" in tensors:
            input_scales[prefix] = tensors["input_scale"]
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(state, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = (
        ct_config(fmt, opts) if fmt.startswith("ct-") else
        {"quant_method": "awq", "bits": 4, "group_size": opts["group"], "zero_point": True, "version": "gemm"}
        if fmt == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": opts["group"], "desc_act": bool(opts.get("act_order")),
         "sym": opts["sym"], "checkpoint_format": "gptq", "lm_head": head})
    if head and fmt.startswith("ct-"):
        config["quantization_config"]["ignore"] = []
    (path / "config.json").write_text(json.dumps(config))
    reference = copy.deepcopy(model)
    if tie:   # the quantized head has weights of its own; the embedding keeps the float table
        reference.lm_head.weight = torch.nn.Parameter(reference.lm_head.weight.detach().clone())
    reference.load_state_dict(deq_state)
    return reference, dequantized, input_scales


def quantize_activations(model, kind: str, input_scales: dict | None = None, rotated: bool = False,
                         lm_head: bool = False):
    """Make a transformers model's decoder projections (and its LM head where `lm_head`) see their input quantized
    per token (or by the layer's static scale) and widened again, as a W8A8 kernel does; float32 math otherwise.
    rotated: quantized as x H and rotated back (H its own inverse), as a layer quantized under the Hadamard rotation
    sees it."""
    for name, module in model.named_modules():
        if (name.startswith("model.layers.") or lm_head and name == "lm_head") and isinstance(module, torch.nn.Linear):
            static = (input_scales or {}).get(name)
            h = block_hadamard(module.in_features) if rotated else None
            module.register_forward_pre_hook(lambda mod, args, static=static, h=h: (
                quantized_input(args[0], kind, static) if h is None else quantized_input(args[0] @ h, kind) @ h,))
    return model


def sylvester(n: int) -> torch.Tensor:
    """The normalised Hadamard matrix of size n (a power of two), by Kronecker products."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), h)
    return h / n ** 0.5


def block_hadamard(k: int) -> torch.Tensor:
    """The [k, k] rotation of a layer with k inputs: Hadamard blocks of the largest power of two dividing k, at
    most 128 (the documented rule of engine.quantization_rotation)."""
    block = min(k & -k, 128)
    return torch.block_diag(*[sylvester(block)] * (k // block))


def quantized_input(x: torch.Tensor, kind: str, static: torch.Tensor | None = None) -> torch.Tensor:
    """x quantized per token (its last dimension) or by a static scale, symmetric, and widened back to float32."""
    top = 127.0 if kind == "int8" else 448.0
    x = x.float()
    scale = static.reshape(()) if static is not None else x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / top
    q = torch.round(x / scale).clamp(-127, 127) if kind == "int8" else \
        (x / scale).clamp(-top, top).to(torch.float8_e4m3fn).float()
    return q * scale


__all__ = ["write_quantized", "quantize_activations", "tiny_tokenizer"]
