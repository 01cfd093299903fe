"""Bytes a linear weight takes per parameter in each format, for the planner's memory and decode-cost models
(decode reads every weight once a step). Scales and zero points included; embeddings, the LM head and norms stay
in the compute dtype (batchrun/quant/load.py) and are priced at its width by the caller."""
from __future__ import annotations

INT4_GROUP = 128


def bytes_per_parameter(quantization: str, compute_bytes: int = 2, in_features: int = 4096,
                        group_size: int = INT4_GROUP) -> float:
    """`quantization`: none (the compute dtype's `compute_bytes`), int8 / int8-w8a16 / fp8 (one byte, plus a
    float32 scale per output channel: 4 / in_features), int4 (half a byte, plus a float32 scale and zero point
    per group of `group_size` input channels)."""
    if quantization == "none":
        return float(compute_bytes)
    if quantization in ("int8", "int8-w8a16", "fp8"):
        return 1.0 + 4.0 / in_features
    if quantization == "int4":
        return 0.5 + 8.0 / group_size
    raise ValueError(f"quantization: no weight size for {quantization!r} (known: none, int8, int8-w8a16, fp8, "
                     f"int4)")
