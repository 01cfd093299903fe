"""Decode requests whose block tables begin with the same blocks: a prefix cached once and shared, such as a long
system prompt over a whole job. The CPU backend attends such a prefix once for all its requests, as a product of
their queries with the prefix's keys (kernels/cpu_attention.shared_prefix_attention), and each request's own
positions after it with the decode kernel, then merges the two by their log-sum-exps. The decode kernel alone reads
the prefix once per request, one query's heads at a time.

SmolLM2's heads, one thread of an AMD EPYC (avx512_bf16), 30 layers' pools, 40 own positions a request
(bench/shared_prefix_decode.py), decode kernel -> shared prefix: bfloat16 32 requests after 1,088 shared
positions 2.01 -> 0.94 ms a layer, after 256 0.61 -> 0.43, 8 after 1,088 0.55 -> 0.40; float32 2.66 -> 2.01, 0.78
-> 0.73, 0.79 -> 0.72. 4 requests or 64 shared positions ran slower (0.5-1.06x): hence the minimums below.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from batchrun.attention_metadata import SharedPrefix

MIN_REQUESTS = 8     # decode requests sharing the prefix
MIN_POSITIONS = 256  # positions in it


def find_shared_prefixes(tables: list[list[int]], lens: list[int], block_size: int,
                         device: torch.device) -> tuple[list[SharedPrefix], torch.Tensor | None]:
    """The prefixes that at least MIN_REQUESTS of these requests (block tables, context lengths with the new token)
    share, each as long as all of them share it and at least MIN_POSITIONS long, and where each request's own
    positions start (0 where it shares none; None where no prefix qualifies). Every request keeps at least its last
    position (the new token's) to read on its own."""
    by_first_block = defaultdict(list)
    for row, table in enumerate(tables):
        if table:
            by_first_block[table[0]].append(row)
    prefixes, starts = [], [0] * len(tables)
    for rows in by_first_block.values():
        if len(rows) < MIN_REQUESTS:
            continue
        first, limit = tables[rows[0]], min((lens[row] - 1) // block_size for row in rows)
        blocks = 0
        while blocks < limit and all(tables[row][blocks] == first[blocks] for row in rows):
            blocks += 1
        if blocks * block_size < MIN_POSITIONS:
            continue
        prefixes.append(SharedPrefix(torch.tensor(rows, device=device), blocks * block_size,
                                     torch.tensor(first[:blocks], device=device)))
        for row in rows:
            starts[row] = blocks * block_size
    return prefixes, (torch.tensor(starts, device=device) if prefixes else None)
