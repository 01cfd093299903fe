"""Prefill attention at bfloat16 and float32: the kernels over the paged blocks (bfloat16 on AVX512-BF16 dot products,
and on AMX tiles where the CPU has them; float32 on AVX-512 FMA) against what the engine runs without them, torch's
SDPA over the chunk's fresh K/V (no cached prefix) or over a gathered copy of the context (after a prefix).

    python bench/prefill_attention.py [--threads 1] [--repeats 20]

SmolLM2-135M's heads (9 query / 3 KV, head_dim 64) and a ~0.3B Llama's (16 / 4, head_dim 64), block size 16, one
chunk per call as the engine calls it. Prints the CPU model and flags, ms per call (median of --repeats) and each
kernel's speedup; a chunk's output is checked against the float32 reference first.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from attention_bench import SHAPES, prefill_dtypes, start
from batchrun.kernels import cpu_attention, reference

CHUNKS = [(355, 355), (1024, 1024), (256, 1280), (512, 2048)]   # (new tokens, context)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    start(args.threads)
    module = cpu_attention.load()
    for dtype in prefill_dtypes():
        tiles = dtype == torch.bfloat16 and module.prefill_amx_ready()
        paths = {"vector": False, "tiles": True} if tiles else {"vector": False}
        print(f"{str(dtype):>14} {'heads':>8} {'new':>5} {'context':>7} {'SDPA ms':>10}"
              + "".join(f" {name + ' ms':>10} {'speedup':>8}" for name in paths))
        for name, (heads, kv_heads, dim) in SHAPES.items():
            for rows, context in CHUNKS:
                print(f"{str(dtype):>14} " + chunk_line(name, heads, kv_heads, dim, rows, context, dtype, paths,
                                                       args.repeats))


def chunk_line(name, heads, kv_heads, dim, rows, context, dtype, paths, repeats) -> str:
    gen = torch.Generator().manual_seed(rows + context)
    blocks = -(-context // 16)
    k = torch.randn(2 * blocks, 16, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(2 * blocks, 16, kv_heads, dim, generator=gen).to(dtype)
    table = torch.randperm(2 * blocks, generator=gen)[:blocks]
    query = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    scale = dim ** -0.5
    want = reference.paged_prefill_attention(query.float(), k.float(), v.float(), table, context, scale)
    for tiles in paths.values():
        got = cpu_attention.paged_prefill_attention(query, k, v, table, context, scale, tiles=tiles)
        torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=2e-2, atol=2e-2)
    if rows == context:   # the engine's path without a prefix: SDPA over the fresh K/V
        key, value = (reference.gather_kv(c, None, table[None], context, dtype)[0].transpose(0, 1).contiguous()
                      for c in (k, v))
        before = timed(lambda: reference.causal_attention(query, key, value, scale), repeats)
    else:
        before = timed(lambda: reference.paged_prefill_attention(query, k, v, table, context, scale), repeats)
    line = f"{name:>8} {rows:>5} {context:>7} {before:>10.2f}"
    for tiles in paths.values():
        after = timed(lambda: cpu_attention.paged_prefill_attention(query, k, v, table, context, scale, tiles=tiles),
                      repeats)
        line += f" {after:>10.2f} {before / after:>7.2f}x"
    return line


if __name__ == "__main__":
    main()
