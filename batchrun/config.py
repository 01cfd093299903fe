"""Engine configuration and its validation (each error names the field)."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Literal, get_args

# Choices as types: the job spec and its JSON Schema take them from the annotations below.
KVCacheDtype = Literal["auto", "float32", "float16", "bfloat16", "int8", "fp8"]
ComputeDtype = Literal["auto", "float32", "float16", "bfloat16"]
AttentionBackend = Literal["auto", "torch", "triton"]
# Weight quantization of a float checkpoint at load (batchrun/quant/formats.py); a quantized checkpoint runs in
# its own format with none or auto.
Quantization = Literal["none", "auto", "int8", "int8-w8a16", "fp8", "int4"]
# The Hadamard rotation of the quantized layers' inputs (batchrun/quant/rotation.py), for weights quantized at load:
# auto = on for int8 (where it was measured to help), off for fp8 and int4 (where it hurt).
QuantizationRotation = Literal["auto", "hadamard", "none"]
KV_CACHE_DTYPES, ATTENTION_BACKENDS = get_args(KVCacheDtype), get_args(AttentionBackend)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(value: str | int | float, field: str = "kv_cache_memory") -> int:
    """'2GiB', '512MiB', '1.5GB' or a byte count -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(f"{field}: cannot parse {value!r} as a memory size; "
                             "use a byte count or a number with a unit such as '512MiB', '2GiB' or '4GB'")
        size = float(m.group(1)) * _UNITS[unit]
    if size <= 0:
        raise ValueError(f"{field}: must be a positive size, got {value!r}")
    return int(size)


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    tokenizer: str | None = None
    trust_remote_code: bool = False
    device: str = "auto"                 # "auto" -> cuda when available, else cpu
    # Compute dtype. "auto": bfloat16 on CPUs with native bf16 (probed), else float32; on CUDA the model's 16-bit dtype.
    dtype: ComputeDtype = "auto"
    kv_cache_dtype: KVCacheDtype = "auto"   # storage dtype of the paged KV cache
    quantization: Quantization = "none"     # weights: none, int8 (W8A8), int8-w8a16, fp8, int4 (W4A16), auto
    quantization_rotation: QuantizationRotation = "auto"   # weights quantized at load: auto, hadamard, none
    # Weights quantized at load: the LM head too (an embedding tied to it is then held as int8 rows). Off by
    # default, as vLLM and llm-compressor leave the head; batchrun kvcheck measures what it costs a job.
    quantization_lm_head: bool = False
    kv_cache_memory: str | int | None = None  # KV pool budget; default 2GiB on CPU, profiled on CUDA
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None     # default: the model's context length
    enable_prefix_caching: bool = True
    attention_backend: AttentionBackend = "auto"
    seed: int = 0
    # A row's logits do not depend on what else shares its step (batch-invariant products and attention, see
    # engine/deterministic.py): a row re-run alone or a resumed job gives the same outputs, at a measured cost.
    deterministic: bool = False
    # Interactive lane: its own 16-bit KV pool (float32 on CPU), admitted first, capped, never preempted by batch.
    interactive_lane: bool = False
    interactive_kv_memory: str | int | None = None   # default: an eighth of the KV budget
    interactive_kv_cache_dtype: KVCacheDtype = "auto"
    interactive_max_num_seqs: int = 8
    interactive_token_share: float = 0.5             # at most this share of a step's tokens; batch keeps the rest
    # While interactive requests are in the engine, the batch lane computes at most this many tokens per step
    # (None: what the interactive lane leaves). Where step time grows with every token (CPUs), a small cap keeps
    # interactive latency near an idle engine's, at a cost in batch throughput while interactive traffic lasts.
    batch_tokens_while_interactive: int | None = None
    # LoRA adapters (PEFT directories) by name, selected per request (SamplingParams.adapter); at most
    # max_adapters of them loaded at a time (least recently used evicted).
    adapters: dict[str, str] | None = None
    max_adapters: int = 8
    # Ranks the model is split over (Megatron tensor parallelism, a process per rank: batchrun/engine/parallel).
    tensor_parallel_size: int = 1

    def __post_init__(self):
        self.kv_cache_bytes = None if self.kv_cache_memory is None else parse_memory(self.kv_cache_memory)
        if self.dtype not in get_args(ComputeDtype):
            raise ValueError(f"dtype: unknown value {self.dtype!r}; allowed: {', '.join(get_args(ComputeDtype))}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: unknown value {self.kv_cache_dtype!r}; allowed: {', '.join(KV_CACHE_DTYPES)}")
        if self.quantization not in get_args(Quantization):
            raise ValueError(f"quantization: unknown value {self.quantization!r}; "
                             f"allowed: {', '.join(get_args(Quantization))}")
        if self.quantization_rotation not in get_args(QuantizationRotation):
            raise ValueError(f"quantization_rotation: unknown value {self.quantization_rotation!r}; "
                             f"allowed: {', '.join(get_args(QuantizationRotation))}")
        if not isinstance(self.quantization_lm_head, bool):
            raise ValueError(f"quantization_lm_head: must be true or false, got {self.quantization_lm_head!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: unknown value {self.attention_backend!r}; "
                             f"allowed: {', '.join(ATTENTION_BACKENDS)}")
        self.interactive_kv_bytes = (None if self.interactive_kv_memory is None
                                     else parse_memory(self.interactive_kv_memory, "interactive_kv_memory"))
        if self.interactive_kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"interactive_kv_cache_dtype: unknown value {self.interactive_kv_cache_dtype!r}; "
                             f"allowed: {', '.join(KV_CACHE_DTYPES)}")
        if not 0 < self.interactive_token_share < 1:
            raise ValueError(f"interactive_token_share: must be in (0, 1), got {self.interactive_token_share!r}")
        if self.adapters is not None and (not isinstance(self.adapters, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.adapters.items())):
            raise ValueError(f"adapters: must map adapter names to adapter directories, got {self.adapters!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "interactive_max_num_seqs",
                     "max_adapters", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("max_model_len", "batch_tokens_while_interactive"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.tensor_parallel_size > 1 and (self.adapters or self.quantization != "none"):
            what = "LoRA adapters" if self.adapters else f"quantization {self.quantization!r}"
            raise ValueError(f"tensor_parallel_size: {self.tensor_parallel_size} ranks with {what} is not supported "
                             f"yet (one rank, tensor_parallel_size: 1, runs them)")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
