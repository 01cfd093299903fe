"""Read one checkpoint module (name prefix `p`, e.g. `model.layers.0.mlp.up_proj`) into the canonical
QuantizedWeight, per format:

  load                  p.weight (float): quantized here (quantize.py)
  compressed-tensors    p.weight (int8 / float8_e4m3fn) or p.weight_packed (int32, values + 2^(bits-1), packed
                        along the input dimension from the low bits, with p.weight_shape), p.weight_scale ([N, 1],
                        [N, K / G] or one value), p.input_scale (static activations)
  AWQ (GEMM)            p.qweight int32 [K, N / 8] and p.qzeros int32 [K / G, N / 8], packed along the output
                        dimension in AWQ's nibble order 0 2 4 6 1 3 5 7; p.scales [K / G, N]
  GPTQ                  p.qweight int32 [K / 8, N] packed along the input dimension, p.qzeros int32 [K / G, N / 8]
                        (stored minus one in checkpoint_format gptq), p.scales [K / G, N], p.g_idx [K] (act-order:
                        the group of each input channel)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from batchrun.quant import quantize
from batchrun.quant.formats import Scheme
from batchrun.quant.weights import QuantizedWeight, pack_int4

AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]   # natural column m of a packed word sits at nibble AWQ_REVERSE_ORDER[m]
# The tensors a quantized module may have besides its bias, per format (the plan routes them to the module).
SUFFIXES = ("weight", "weight_scale", "input_scale", "weight_packed", "weight_shape", "weight_zero_point",
            "weight_g_idx", "qweight", "qzeros", "scales", "g_idx")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 // bits values each, the first in the low bits, spread along `dim` -> int32 values."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)    # [..., per]
    if dim == 1:
        return values.reshape(packed.shape[0], packed.shape[1] * per)
    return values.permute(0, 2, 1).reshape(packed.shape[0] * per, packed.shape[1])


def _check(prefix: str, name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if t.dtype not in dtypes:
        raise ValueError(f"model: tensor {prefix}.{name} has dtype {t.dtype}; this format stores "
                         f"{' or '.join(str(d).removeprefix('torch.') for d in dtypes)}")
    return t


def read_module(scheme: Scheme, tensors, prefix: str) -> QuantizedWeight:
    """`tensors`: the checkpoint's (engine/loader.Tensors)."""
    reader = {"load": _load_time, "compressed-tensors": _compressed_tensors, "awq": _awq, "gptq": _gptq}
    return reader[scheme.source](scheme, tensors, prefix)


def _load_time(scheme: Scheme, tensors, prefix: str) -> QuantizedWeight:
    rotate, activations = scheme.options.get("rotate", False), scheme.activations
    quantizer = {"int8": lambda w: quantize.int8_per_channel(w, activations, rotate),
                 "fp8": lambda w: quantize.fp8_per_channel(w, activations, rotate),
                 "int4": lambda w: quantize.int4_grouped(w, rotate_input=rotate)}[scheme.weights]
    return quantize_by_rows(tensors, f"{prefix}.weight", quantizer)


CHUNK_BYTES = 4 * 2**20   # float32 rows quantized at a time: the load's transient beside the weights held


def quantize_by_rows(tensors, name: str, quantizer: Callable[[torch.Tensor], QuantizedWeight]) -> QuantizedWeight:
    """A float checkpoint tensor [N, K] quantized a chunk of rows at a time (every format here quantizes each row
    on its own), into tensors allocated once: the float tensor is never whole in memory (SmolLM2's tied 49,152 x
    576 float32 table and its rotated copy would be 8 times its int8 codes, all beside the model loaded so far)."""
    n, k = tensors.shape(name)
    rows = max(1, CHUNK_BYTES // (4 * k))
    out = None
    for start in range(0, n, rows):
        chunk = tensors.read(name, (0, start, min(n, start + rows)))
        if not chunk.is_floating_point() or chunk.element_size() == 1:
            raise ValueError(f"model: tensor {name} has dtype {chunk.dtype}; quantizing at load needs float weights")
        part = quantizer(chunk)
        if out is None:
            full = {f: None if t is None else t.new_empty((n, *t.shape[1:]))
                    for f, t in (("data", part.data), ("scale", part.scale), ("zeros", part.zeros))}
            out = replace(part, **full)
        for field in ("data", "scale", "zeros"):
            if getattr(part, field) is not None:
                getattr(out, field)[start:start + len(part.data)] = getattr(part, field)
    return out


def _compressed_tensors(scheme: Scheme, tensors, prefix: str) -> QuantizedWeight:
    scale = tensors.read(f"{prefix}.weight_scale").float()
    if scheme.weights == "int4":
        shape = tensors.read(f"{prefix}.weight_shape").tolist()
        q = unpack_int32(_check(prefix, "weight_packed", tensors.read(f"{prefix}.weight_packed"), (torch.int32,)), 4, 1)
        q = q[:, :shape[1]]
        group = scheme.options["group_size"] or shape[1]
        scale = scale.reshape(shape[0], -1)
        if scale.shape[1] * group != shape[1]:
            raise ValueError(f"model: tensor {prefix}.weight_scale has shape {list(scale.shape)}, expected "
                             f"[{shape[0]}, {shape[1] // group}] (group size {group})")
        return QuantizedWeight("int4", pack_int4(q), scale, torch.full_like(scale, 8.0), group)
    if scheme.options["layout"] == "pack-quantized":
        shape = tensors.read(f"{prefix}.weight_shape").tolist()
        packed = _check(prefix, "weight_packed", tensors.read(f"{prefix}.weight_packed"), (torch.int32,))
        data = (unpack_int32(packed, 8, 1)[:, :shape[1]] - 128).to(torch.int8)
    else:
        expected = torch.float8_e4m3fn if scheme.weights == "fp8" else torch.int8
        data = _check(prefix, "weight", tensors.read(f"{prefix}.weight"), (expected,))
    scale = scale.reshape(-1)
    if scale.numel() not in (1, data.shape[0]):
        raise ValueError(f"model: tensor {prefix}.weight_scale has {scale.numel()} values; expected 1 (tensor) "
                         f"or {data.shape[0]} (channel)")
    input_scale = None
    if scheme.activations != "none" and tensors.has(f"{prefix}.input_scale"):
        input_scale = tensors.read(f"{prefix}.input_scale").float().reshape(-1).max()
    return QuantizedWeight(scheme.weights, data, scale.expand(data.shape[0]).contiguous(),
                           activations=scheme.activations, input_scale=input_scale)


def _awq(scheme: Scheme, tensors, prefix: str) -> QuantizedWeight:
    def natural(packed: torch.Tensor) -> torch.Tensor:   # [R, C] words -> [R, 8 C] values in column order
        values = unpack_int32(packed, 4, 1).reshape(packed.shape[0], -1, 8)
        return values[:, :, AWQ_REVERSE_ORDER].reshape(packed.shape[0], -1)
    q = natural(_check(prefix, "qweight", tensors.read(f"{prefix}.qweight"), (torch.int32,))).t()   # [N, K]
    zeros = natural(_check(prefix, "qzeros", tensors.read(f"{prefix}.qzeros"), (torch.int32,))).t().float()
    scales = tensors.read(f"{prefix}.scales").float().t().contiguous()
    return _int4(prefix, q, scales, zeros, scheme.options["group_size"])


def _gptq(scheme: Scheme, tensors, prefix: str) -> QuantizedWeight:
    q = unpack_int32(_check(prefix, "qweight", tensors.read(f"{prefix}.qweight"), (torch.int32,)), 4, 0).t()   # [N, K]
    zeros = unpack_int32(_check(prefix, "qzeros", tensors.read(f"{prefix}.qzeros"), (torch.int32,)), 4, 1)
    scales = tensors.read(f"{prefix}.scales").float()
    zeros = (zeros[:, :scales.shape[1]] + scheme.options["zero_offset"]).float().t().contiguous()
    scales = scales.t().contiguous()
    n, k = q.shape
    group = scheme.options["group_size"] if scheme.options["group_size"] != -1 else k
    perm = None
    if tensors.has(f"{prefix}.g_idx"):
        g_idx = tensors.read(f"{prefix}.g_idx").long()
        if not torch.equal(g_idx, torch.arange(k) // group):   # act-order: gather each group's channels together
            counts = torch.bincount(g_idx, minlength=k // group)
            if g_idx.numel() != k or counts.numel() != k // group or bool((counts != group).any()):
                raise ValueError(f"model: tensor {prefix}.g_idx does not give every group {group} input channels")
            perm = torch.argsort(g_idx, stable=True)
            q = q[:, perm]
    weight = _int4(prefix, q, scales, zeros, group)
    weight.input_perm = perm
    return weight


def _int4(prefix: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> QuantizedWeight:
    n, k = q.shape
    if k % group or scales.shape != (n, k // group) or zeros.shape != (n, k // group):
        raise ValueError(f"model: {prefix}: scales {list(scales.shape)} / zeros {list(zeros.shape)} do not match "
                         f"the weight [{n}, {k}] in groups of {group}")
    return QuantizedWeight("int4", pack_int4(q), scales, zeros, group)
