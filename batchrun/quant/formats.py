"""Which weight quantization a run uses: read from the checkpoint's `quantization_config` (compressed-tensors,
AWQ, GPTQ) or asked for with `engine.quantization` on a float checkpoint. Anything else is refused here, from
config.json alone, before any weight is read, with a message naming the format and the part not supported.

A Scheme turns one checkpoint module (its name prefix, e.g. `model.layers.0.self_attn.q_proj`) into the canonical
QuantizedWeight (weights.py); the checkpoint readers live in checkpoints.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

import torch

from batchrun.config import Quantization

QUANTIZATIONS = get_args(Quantization)
LOAD_TIME = {   # engine.quantization -> (kind, activations, what it is)
    "int8": ("int8", "int8", "int8 W8A8: per-channel weight scales, activations quantized per token"),
    "int8-w8a16": ("int8", "none", "int8 W8A16: per-channel weight scales, 16-bit activations"),
    "fp8": ("fp8", "fp8", "fp8 e4m3 W8A8: per-channel weight scales, activations quantized per token"),
    "int4": ("int4", "none", "int4 W4A16: asymmetric, groups of 128 input channels (64 or 32 where 128 does "
                             "not divide the layer)"),
}
# quantization_rotation auto: int8 rotated (SmolLM2's articles: W8A8 log-likelihood drop 0.020 -> 0.002 nats a
# token, W8A16 0.005 -> 0.000); fp8 (0.038 -> 0.043) and int4 (0.10 -> 0.23) lost by it (bench/quant_quality.py)
ROTATED_BY_DEFAULT = ("int8",)
MOE_TYPES = ("mixtral", "qwen3_moe")
REFUSED_METHODS = {"bitsandbytes": "bitsandbytes (nf4 / int8)", "hqq": "HQQ", "gguf": "GGUF", "exl2": "EXL2",
                   "quanto": "Quanto", "torchao": "torchao", "mxfp4": "MXFP4", "modelopt": "ModelOpt",
                   "fp8": "the 'fp8' method (block-wise or static FP8)", "aqlm": "AQLM", "eetq": "EETQ",
                   "fbgemm_fp8": "FBGEMM FP8", "higgs": "HIGGS", "vptq": "VPTQ", "spqr": "SpQR",
                   "bitnet": "BitNet", "marlin": "Marlin", "gptq_marlin": "GPTQ-Marlin", "awq_marlin": "AWQ-Marlin"}


@dataclass(frozen=True)
class Scheme:
    """How the decoder's linear layers are quantized. `source`: "load" (quantized from a float checkpoint at
    load), "compressed-tensors", "awq" or "gptq". `weights` / `activations`: the canonical kind ("int8", "fp8",
    "int4") and what the input goes through ("none", "int8", "fp8"). `options`: the format's own settings."""
    source: str
    weights: str
    activations: str
    description: str
    options: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def label(self) -> str:
        return self.description.split(":")[0]


def _fail(fmt: str, part: str, supported: str) -> ValueError:
    return ValueError(f"model: quantization format {fmt}: {part} is not supported (supported: {supported})")


def scheme_for(hf_config, quantization: str = "none", device_type: str = "cpu", rotation: str = "auto",
               lm_head: bool = False) -> Scheme | None:
    """The run's scheme (None: float weights), or a ValueError naming what is not supported. `rotation`
    (engine.quantization_rotation): whether weights quantized at load get the Hadamard rotation (rotation.py);
    `lm_head` (engine.quantization_lm_head): whether they include the LM head."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: unknown value {quantization!r}; allowed: {', '.join(QUANTIZATIONS)}")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    if qc:
        if quantization not in ("none", "auto"):
            raise ValueError(f"quantization: the checkpoint is already quantized ({qc.get('quant_method')!r} "
                             f"in config.json); engine.quantization {quantization!r} applies to float checkpoints "
                             f"only (use none or auto)")
        if rotation == "hadamard":
            raise ValueError(f"quantization_rotation: the checkpoint is already quantized "
                             f"({qc.get('quant_method')!r} in config.json); 'hadamard' applies to weights "
                             f"quantized at load (use auto or none)")
        if lm_head:
            raise ValueError(f"quantization_lm_head: the checkpoint is already quantized "
                             f"({qc.get('quant_method')!r} in config.json); the LM head is quantized by batchrun "
                             f"only with weights quantized at load (use false)")
        scheme = checkpoint_scheme(qc)
        if hf_config.model_type in MOE_TYPES:
            raise _fail(scheme.label, f"quantized mixture-of-experts weights ({hf_config.model_type})",
                        "dense decoder models")
        return scheme
    if quantization == "auto":
        quantization = auto_choice(device_type)
    if quantization == "none":
        return None
    kind, activations, description = LOAD_TIME[quantization]
    rotate = rotation == "hadamard" or (rotation == "auto" and kind in ROTATED_BY_DEFAULT)
    details = (", inputs Hadamard-rotated" if rotate else "") + (", LM head included" if lm_head else "")
    return Scheme("load", kind, activations, f"{description} (quantized at load{details})",
                  {"rotate": rotate, "lm_head": lm_head})


def auto_choice(device_type: str) -> str:
    """What `auto` picks. CPU: int8 W8A8 (oneDNN's int8 product on a pre-packed weight ran a decode step's
    products 2.2-2.9x faster than the packed bfloat16 path, the other formats slower or not faster; see
    cpu_kernels.py). CUDA: fp8 on compute capability 8.9+ (torch._scaled_mm), else int8."""
    if device_type == "cuda":
        return "fp8" if torch.cuda.get_device_capability() >= (8, 9) else "int8"
    return "int8" if hasattr(torch.ops.onednn, "qlinear_pointwise") else "none"


def checkpoint_scheme(qc: dict) -> Scheme:
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    name = REFUSED_METHODS.get(method, repr(method))
    raise _fail(name, "the format", "compressed-tensors FP8/INT8 W8A8 and W8A16, INT4 W4A16; AWQ GEMM 4-bit; "
                                    "GPTQ 4-bit")


def declares_lm_head(qc: dict) -> bool:
    """Whether a checkpoint's quantization_config quantizes the LM head too (the loader reads it from the tensors
    themselves): compressed-tensors targeting Linear without lm_head in `ignore`, GPTQ's `lm_head: true`."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        targets = {t for group in (qc.get("config_groups") or {}).values() for t in group.get("targets") or []}
        ignored = any("lm_head" in entry for entry in qc.get("ignore") or [])   # a name or a "re:" pattern
        return ("Linear" in targets or "lm_head" in targets) and not ignored
    return method == "gptq" and bool(qc.get("lm_head"))


CT_SUPPORTED = ("FP8 W8A8 / W8A16 (tensor or channel weight scales, per-token dynamic or static tensor "
                "activations), INT8 W8A8 / W8A16 (same), INT4 W4A16 symmetric (group or channel, pack-quantized)")


def _compressed_tensors(qc: dict) -> Scheme:
    fmt = "compressed-tensors"
    if qc.get("kv_cache_scheme"):
        raise _fail(fmt, "kv_cache_scheme (KV scales in the checkpoint; batchrun quantizes its KV cache itself, "
                         "engine.kv_cache_dtype)", CT_SUPPORTED)
    if qc.get("sparsity_config"):
        raise _fail(fmt, "sparsity_config (sparse weights)", CT_SUPPORTED)
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise _fail(fmt, "a quantization_config without config_groups", CT_SUPPORTED)
    schemes = {_ct_group(fmt, str(qc.get("format", "")), g) for g in groups}
    if len(schemes) > 1:
        raise _fail(fmt, "config_groups with different schemes (" +
                    ", ".join(sorted(s.description for s in schemes)) + ")", CT_SUPPORTED)
    return schemes.pop()


def _ct_group(fmt: str, layout: str, group: dict) -> Scheme:
    w, a = group.get("weights") or {}, group.get("input_activations")
    bits, wtype, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    what = f"weights {wtype} {bits}-bit {strategy}"
    if not w.get("symmetric", True):
        raise _fail(fmt, f"{what} asymmetric (zero points)", CT_SUPPORTED)
    if w.get("dynamic") or w.get("actorder"):
        raise _fail(fmt, f"{what} with {'dynamic weights' if w.get('dynamic') else 'actorder'}", CT_SUPPORTED)
    if group.get("output_activations"):
        raise _fail(fmt, "output_activations", CT_SUPPORTED)
    if (wtype, bits) == ("int", 4):
        if strategy not in ("group", "channel") or layout != "pack-quantized" or a:
            raise _fail(fmt, f"{what}, format {layout!r}, activations {a}", CT_SUPPORTED)
        group = f" {w.get('group_size')}" if strategy == "group" else ""
        return Scheme("compressed-tensors", "int4", "none", f"compressed-tensors INT4 W4A16 ({strategy}{group})",
                      {"group_size": w.get("group_size") if strategy == "group" else None, "bits": 4})
    if (wtype, bits) not in (("float", 8), ("int", 8)) or strategy not in ("tensor", "channel"):
        raise _fail(fmt, what, CT_SUPPORTED)
    kind = "fp8" if wtype == "float" else "int8"
    if layout not in ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized"):
        raise _fail(fmt, f"format {layout!r}", CT_SUPPORTED)
    if a is None:
        activations = "none"
    else:
        dynamic_token = a.get("strategy") == "token" and a.get("dynamic")
        static_tensor = a.get("strategy") == "tensor" and not a.get("dynamic")
        if (a.get("type"), a.get("num_bits")) != (wtype, 8) or not (dynamic_token or static_tensor) or \
                not a.get("symmetric", True):
            raise _fail(fmt, f"input_activations {a.get('type')} {a.get('num_bits')}-bit {a.get('strategy')} "
                             f"{'dynamic' if a.get('dynamic') else 'static'}"
                             f"{'' if a.get('symmetric', True) else ' asymmetric'}", CT_SUPPORTED)
        activations = kind
    name = f"compressed-tensors {kind.upper()} W8A{8 if activations != 'none' else 16} ({strategy} weight scales)"
    return Scheme("compressed-tensors", kind, activations, name, {"layout": layout, "bits": 8})


def _awq(qc: dict) -> Scheme:
    supported = "AWQ GEMM, 4-bit, with zero points"
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _fail("AWQ", f"version {qc.get('version')!r}", supported)
    if qc.get("bits", qc.get("w_bit")) != 4:
        raise _fail("AWQ", f"{qc.get('bits', qc.get('w_bit'))}-bit weights", supported)
    if not qc.get("zero_point", True):
        raise _fail("AWQ", "zero_point false", supported)
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or group <= 0:
        raise _fail("AWQ", f"group_size {group!r}", supported)
    return Scheme("awq", "int4", "none", f"AWQ 4-bit W4A16 (GEMM, group {group})", {"group_size": group})


def _gptq(qc: dict) -> Scheme:
    supported = "GPTQ 4-bit, any group size, sym or asym, with or without desc_act, checkpoint_format gptq/gptq_v2"
    if qc.get("bits") != 4:
        raise _fail("GPTQ", f"{qc.get('bits')}-bit weights", supported)
    layout = qc.get("checkpoint_format", "gptq")
    if layout not in ("gptq", "gptq_v2"):
        raise _fail("GPTQ", f"checkpoint_format {layout!r}", supported)
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise _fail("GPTQ", f"group_size {group!r}", supported)
    act = "act-order" if qc.get("desc_act") else "no act-order"
    return Scheme("gptq", "int4", "none", f"GPTQ 4-bit W4A16 (group {group}, "
                                          f"{'sym' if qc.get('sym', True) else 'asym'}, {act})",
                  {"group_size": group, "zero_offset": 1 if layout == "gptq" else 0})
