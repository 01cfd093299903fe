"""Greedy, temperature, top-k and top-p sampling with per-request seeds; optional chosen-token logprobs."""
from __future__ import annotations

import torch

from batchrun.engine.request import Request


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)   # for requests without their own seed

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[float | None]]:
        logits = logits.float().cpu()
        tokens = logits.argmax(dim=-1)
        for i, request in enumerate(requests):
            if not request.params.greedy:
                tokens[i] = self._sample_row(logits[i], request)
        logprobs: list[float | None] = [None] * len(requests)
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs]
        if wanted:
            rows = torch.log_softmax(logits[wanted], dim=-1)
            chosen = rows.gather(1, tokens[wanted, None])[:, 0].tolist()
            for i, value in zip(wanted, chosen):
                logprobs[i] = value
        return tokens.tolist(), logprobs

    def _sample_row(self, row: torch.Tensor, request: Request) -> int:
        params = request.params
        row = row / params.temperature
        if params.top_k > 0 and params.top_k < row.numel():
            kth = torch.topk(row, params.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
            probs = probs.scatter(0, order[drop], 0.0)
        if params.seed is not None and request.generator is None:
            request.generator = torch.Generator().manual_seed(params.seed)
        return int(torch.multinomial(probs, 1, generator=request.generator or self.generator))
