"""Decode attention over a prefix that several requests share: the decode kernel reading every request's whole
context against the shared-prefix path (the prefix once for all of them as a product, each request's own positions on
the decode kernel, the two merged: engine/shared_prefix.py), at bfloat16 and float32.

    python bench/shared_prefix_decode.py [--threads 1] [--layers 30]

SmolLM2-135M's heads (9 query / 3 KV, head_dim 64) and a ~0.3B Llama's (16 / 4), block size 16, 40 positions of
each request's own after the prefix; each of --layers layers has its own pool, read in turn as a step reads them
(each layer's own blocks cold). Prints the CPU model and flags and ms per layer (best of 3 passes); the merged output
is checked against the float32 reference first.
"""
from __future__ import annotations

import argparse
import time

import torch

from attention_bench import SHAPES, prefill_dtypes, start
from batchrun.kernels import cpu_attention, reference

CASES = [(32, 1088), (32, 256), (32, 64), (8, 1088), (4, 1088)]   # (requests, shared positions)
OWN, BLOCK = 40, 16


def case_line(shape, requests, prefix, dtype, layers) -> str:
    heads, kv_heads, dim = SHAPES[shape]
    shared_blocks, own_blocks = prefix // BLOCK, -(-OWN // BLOCK)
    blocks = shared_blocks + requests * own_blocks
    pools = [(torch.randn(blocks, BLOCK, kv_heads, dim).to(dtype), torch.randn(blocks, BLOCK, kv_heads, dim).to(dtype))
             for _ in range(layers)]
    tables = torch.stack([torch.cat([torch.arange(shared_blocks),
                                     shared_blocks + r * own_blocks + torch.arange(own_blocks)]) for r in range(requests)])
    lens = torch.full((requests,), prefix + OWN)
    starts = torch.full((requests,), prefix)
    query = torch.randn(requests, heads, dim).to(dtype)
    scale = dim ** -0.5

    def whole(k, v):
        return cpu_attention.paged_decode_attention(query, k, v, tables, lens, scale)

    def shared(k, v):
        part, part_lse = cpu_attention.shared_prefix_attention(query, k, v, tables[0, :shared_blocks], prefix, scale)
        own, own_lse = cpu_attention.decode_attention_from(query, k, v, tables, lens, starts, scale)
        return cpu_attention.merge_parts(part, part_lse, own, own_lse)

    k, v = pools[0]
    expected = reference.paged_decode_attention(query.float(), k.float(), v.float(), tables, lens, scale, None, None,
                                                prefix + OWN)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(shared(k, v).float(), expected, **tol)
    best = {}
    for name, fn in [("whole", whole), ("shared", shared)] * 3:
        start = time.perf_counter()
        for k, v in pools:
            fn(k, v)
        best[name] = min(best.get(name, float("inf")), 1e3 * (time.perf_counter() - start) / layers)
    return (f"{str(dtype):>14} {shape:>8} {requests:>8} {prefix:>7} {best['whole']:>9.3f} {best['shared']:>10.3f} "
            f"{best['whole'] / best['shared']:>7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    start(args.threads)
    for dtype in prefill_dtypes():
        print(f"{str(dtype):>14} {'heads':>8} {'requests':>8} {'shared':>7} {'whole ms':>9} {'shared ms':>10} "
              f"{'speedup':>7}")
        for shape in SHAPES:
            for requests, prefix in CASES:
                print(case_line(shape, requests, prefix, dtype, args.layers))


if __name__ == "__main__":
    main()
