"""Deterministic attention: every query row of a step, decode or prefill, attends as a decode of its own.

A prefill chunk's query at position p is computed like the decode of the token at p: its own block table, a context
of p + 1 tokens read from the paged cache, one fixed order over the keys. So a row's attention output depends only on
its query and the cached K/V before it, not on the other rows of the step, where the chunk boundaries fell, whether
the prefix came from the prefix cache, or whether the token is decoded or recomputed after a preemption. The price:
prefill reads each key once per query instead of once per query tile (see README, deterministic mode).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from batchrun.attention_metadata import AttentionMetadata


class RowTables(NamedTuple):
    block_tables: torch.Tensor   # [T, max_blocks] int64: each row's request's blocks, padded with block 0
    context_lens: torch.Tensor   # [T] int64: the row's position + 1
    max_len: int


def row_tables(meta: AttentionMetadata, num_rows: int, device: torch.device) -> RowTables:
    """One decode per row of the segment; built at the first layer's call and reused by the others."""
    if meta.row_tables is None:
        pieces = [(g.start, g.block_tables, g.context_lens) for g in meta.decode_groups]
        for chunk in meta.prefills:
            first = chunk.context_len - chunk.query_len + 1
            pieces.append((chunk.query_start, chunk.block_table[None].expand(chunk.query_len, -1),
                           torch.arange(first, chunk.context_len + 1, device=device)))
        pieces.sort(key=lambda piece: piece[0])
        covered = 0
        for start, _, lens in pieces:
            if start != covered:
                break
            covered += len(lens)
        if covered != num_rows:
            raise ValueError("deterministic attention: the decode groups and prefill chunks must cover the rows "
                             "back to back")
        width = max(tables.shape[1] for _, tables, _ in pieces)
        tables = torch.cat([F.pad(t, (0, width - t.shape[1])) for _, t, _ in pieces]).long()
        lens = torch.cat([lens for _, _, lens in pieces]).long()
        meta.row_tables = RowTables(tables, lens, int(lens.max()))
    return meta.row_tables
