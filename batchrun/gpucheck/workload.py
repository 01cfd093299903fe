"""The check's prompts: seeded random token ids (the models are random too), lengths spread around a mean, no two
sharing a first block (so no run is helped by the prefix cache)."""
from __future__ import annotations

import torch

FIRST_ID = 3   # after <unk>, <s>, </s>


def random_prompts(count: int, mean_tokens: int, vocab_size: int, seed: int = 0,
                   spread: float = 0.25) -> list[list[int]]:
    """`count` prompts of mean_tokens x (1 +- spread) tokens (uniform), ids uniform in [3, vocab_size)."""
    if count <= 0 or mean_tokens <= 0:
        raise ValueError(f"random_prompts: count and mean_tokens must be positive, got {count} and {mean_tokens}")
    g = torch.Generator().manual_seed(seed)
    low, high = max(1, round(mean_tokens * (1 - spread))), round(mean_tokens * (1 + spread))
    lengths = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return [torch.randint(FIRST_ID, vocab_size, (n,), generator=g).tolist() for n in lengths]


def max_len_for(prompts: list[list[int]], max_tokens: int, block_size: int = 16) -> int:
    """The smallest context (a whole number of blocks) that holds the longest prompt and its output."""
    need = max(len(p) for p in prompts) + max_tokens
    return -(-need // block_size) * block_size
