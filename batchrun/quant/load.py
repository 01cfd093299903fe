"""Load a model with quantized linear layers, one checkpoint module at a time: each decoder projection is read
(or quantized from its float tensor) straight into its kernel's form, so the float model never exists in memory.

The layers quantized are the decoder layers' Linear modules (attention and MLP projections); embeddings, the LM
head, norms and MoE routers stay in the compute dtype, as vLLM and llm-compressor leave them. With
engine.quantization_lm_head the LM head is quantized at load too, and an embedding tied to it is held as int8 rows
(models/layers.Embedding): a 16-bit table kept for the lookup alone would outweigh what the quantized head saves.
A quantized checkpoint whose LM head is quantized too (compressed-tensors without lm_head in `ignore`, GPTQ's
`lm_head: true`) has it read as published, from its own tensors even where the config ties it to the embedding,
which then stays as the checkpoint has it.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from batchrun.models import cpu_gemm
from batchrun.models.layers import Linear
from batchrun.quant import checkpoints, quantize, weights as qweights
from batchrun.quant.formats import Scheme
from batchrun.quant.linear import QuantizedLinear, make_kernel

MARKERS = {"load": "weight", "compressed-tensors": "weight_scale", "awq": "qweight", "gptq": "qweight"}
QUANT_ONLY = set(checkpoints.SUFFIXES) - {"weight"}
EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def targets(model: nn.Module, lm_head: bool = False) -> dict[str, Linear]:
    """The Linear modules that get quantized: the decoder layers' projections, not a MoE router (`.gate`); the LM
    head where asked."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, Linear) and (name.startswith("model.layers.") and not name.endswith(".gate")
                                          or lm_head and name == "lm_head")}


def route(plan: dict[str, tuple[str, ...]], names: set[str], layers: dict[str, Linear], scheme: Scheme
          ) -> dict[str, tuple[str, ...]]:
    """The model's plan with each quantized layer's tensors (weight, scales, zero points...) folded into one entry,
    `<layer>.weight` -> the checkpoint module prefixes fused into it. A quantized tensor anywhere else is refused
    by name (before any weight is read)."""
    routed = {}
    for name, sources in plan.items():
        prefix, _, suffix = name.rpartition(".")
        source_prefixes = tuple(s.rpartition(".")[0] for s in sources)
        quantized = f"{source_prefixes[0]}.{MARKERS[scheme.source]}" in names
        if prefix in layers and suffix in checkpoints.SUFFIXES and quantized:
            routed[f"{prefix}.weight"] = source_prefixes
        elif suffix in QUANT_ONLY:
            raise ValueError(f"model: tensor {sources[0]!r} is quantized ({scheme.label}), but batchrun reads "
                             f"quantized weights only in the decoder layers' linear layers")
        else:
            routed[name] = sources
    return routed


def plan_and_build(model: nn.Module, scheme: Scheme | None, device: torch.device, dtype: torch.dtype
                   ) -> tuple[Callable, Callable | None]:
    """The `plan` and `build` arguments of engine/loader.load_weights: without a scheme the model's own plan; with
    one, each quantized layer gets its kernel (its `quantized`) and an empty weight as it is read."""
    if scheme is None:
        return model.checkpoint_plan, None
    layers = targets(model, scheme.options.get("lm_head", False))
    int8_rows = set()   # the embedding's tensor name, where it is tied to a LM head quantized at load

    def plan(names: list[str]) -> dict[str, tuple[str, ...]]:
        own = model.checkpoint_plan(names)
        if checkpoint_quantizes_head(scheme, set(names)):
            layers["lm_head"] = model.lm_head
            own.pop(LM_HEAD)   # not the embedding's tensor, even where tied: the head's own, routed below
            if LM_HEAD in names:
                own[LM_HEAD] = (LM_HEAD,)
        if "lm_head" not in layers:
            return route(own, set(names), layers, scheme)
        if scheme.source == "load" and own[LM_HEAD] == own[EMBEDDING]:
            int8_rows.add(EMBEDDING)
        # The head first: its kernel's packed copy beside its codes is the load's largest transient, smaller than
        # the model, so it comes before the layers do (building the model peaked at 1.43x -> 1.09x the weights held
        # for SmolLM2 int8, tied; 1.33x -> 1.27x for the 0.3B Llama; bench/quantized.py)
        routed = route(own, set(names), layers, scheme)
        return {LM_HEAD: routed.pop(LM_HEAD), **routed}

    def build(name: str, sources: tuple[str, ...], tensors) -> torch.Tensor | None:
        if name in int8_rows:
            rows = checkpoints.quantize_by_rows(tensors, sources[0], quantize.int8_per_channel)
            embedding = model.get_submodule(name.removesuffix(".weight"))
            embedding.hold_int8(rows.data.to(device), rows.scale.to(device), dtype)
            return embedding.weight.data
        prefix = name.removesuffix(".weight")
        if prefix not in layers or not name.endswith(".weight") or tensors.has(sources[0]):
            return None   # a float tensor (a routed entry's sources are module prefixes, not tensor names)
        parts = [checkpoints.read_module(scheme, tensors, p).to(device) for p in sources]
        layer = layers[prefix]
        layer.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)
        layer.quantized = QuantizedLinear(layer, make_kernel(_group_by_input_order(parts, prefix), dtype),
                                          layer.out_features, scheme.description, sum(p.nbytes for p in parts),
                                          parts[0].rotation, device)
        del parts
        if device.type == "cpu":   # the float read buffers just freed stay resident in glibc's heap otherwise
            cpu_gemm.return_freed_memory(now=True)
        return layer.weight.data
    return plan, build


def checkpoint_quantizes_head(scheme: Scheme, names: set[str]) -> bool:
    """Whether a quantized checkpoint holds its LM head quantized (its own quantized tensors)."""
    return scheme.source != "load" and f"lm_head.{MARKERS[scheme.source]}" in names


def _group_by_input_order(parts: list[qweights.QuantizedWeight], name: str) -> list[qweights.QuantizedWeight]:
    """Fused projections stacked into one canonical weight; where their inputs are gathered in different orders
    (GPTQ act-order) one per order, run side by side."""
    groups: list[list[qweights.QuantizedWeight]] = []
    for part in parts:
        if groups and _same_order(groups[-1][0], part):
            groups[-1].append(part)
        else:
            groups.append([part])
    return [qweights.concat(group, name) for group in groups]


def _same_order(a: qweights.QuantizedWeight, b: qweights.QuantizedWeight) -> bool:
    if a.input_perm is None or b.input_perm is None:
        return a.input_perm is None and b.input_perm is None
    return torch.equal(a.input_perm, b.input_perm)
