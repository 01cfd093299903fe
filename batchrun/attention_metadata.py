"""Per-step attention metadata: built by the model runner, read by the model and the attention backends.

A bottom module (it imports only torch), so the model, the runner and every backend depend on it and not on each
other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PrefillChunk:
    query_start: int        # offset of the chunk's first token in the step's token dimension
    query_len: int
    context_len: int        # tokens of the request in the cache after this step, the chunk included
    block_table: torch.Tensor


@dataclass
class SharedPrefix:
    """Leading blocks that several decode requests share (engine/shared_prefix.py)."""
    rows: torch.Tensor          # the decode group's rows that share it
    length: int                 # positions, whole blocks
    block_table: torch.Tensor   # its blocks


@dataclass
class DecodeGroup:
    """Consecutive decode requests of similar context length, padded together to `max_len`."""
    start: int
    end: int
    block_tables: torch.Tensor   # [end - start, max_blocks]
    context_lens: torch.Tensor   # [end - start], the new token included
    max_len: int
    # for backends that read shared prefixes apart (reads_shared_prefixes): the prefixes, and where each row's own
    # positions start (None: no prefix found)
    shared_prefixes: list[SharedPrefix] = field(default_factory=list)
    own_starts: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner; decode requests come first in the token dimension."""
    slot_mapping: torch.Tensor                 # [T] cache slot of each new token, -1 to skip
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    triton_step: Any = None   # tensors the Triton backend derives once per step, at the first layer
    row_tables: Any = None    # deterministic mode: one decode per row (engine/row_attention.py), built likewise


@dataclass
class Segment:
    """Consecutive rows of the step's tokens whose K/V live in one KV pool (one lane)."""
    start: int
    end: int
    pool: int
    meta: AttentionMetadata
