"""After the forward, each request's sampling and grammar step on its own: one request whose sampling or grammar
fails ends alone (its reason in `failed`), and the step goes on for the others."""
from __future__ import annotations

from typing import Callable

import torch

from batchrun.engine.request import Request

Sampled = tuple[Request, int, float | None]   # (request, token, logprob)


def sample_alone_on_failure(sampler: Callable, logits: torch.Tensor, requests: list[Request],
                            failed: dict[Request, str]) -> list[Sampled]:
    """(request, token, logprob) for each request not in `failed`. When the batched sampler raises, each request
    is sampled alone, and those that still raise join `failed`; when every one of them raises, the fault is not
    one request's and it propagates."""
    live = [i for i, r in enumerate(requests) if r not in failed]
    if not live:
        return []
    rows = [requests[i] for i in live]
    try:
        tokens, logprobs = sampler(logits if len(live) == len(requests) else logits[live], rows)
        return list(zip(rows, tokens, logprobs))
    except Exception as exc:   # noqa: BLE001 -- find the request(s) it came from
        batch_error = exc
    sampled = []
    for i, request in zip(live, rows):
        try:
            (token,), (logprob,) = sampler(logits[i:i + 1], [request])
            sampled.append((request, token, logprob))
        except Exception as exc:   # noqa: BLE001
            failed[request] = f"sampling failed: {type(exc).__name__}: {exc}"
    if not sampled and len(rows) > 1:
        raise batch_error
    return sampled


def accept_into_grammar(request: Request, token: int, failed: dict[Request, str]) -> bool:
    """Feed the sampled token to the request's grammar; False (and the request in `failed`) when it cannot."""
    if request.grammar is None:
        return True
    try:
        if request.grammar.accept_token(token):
            return True
        failed[request] = f"structured output: the grammar refused token {token}"
    except Exception as exc:   # noqa: BLE001
        failed[request] = f"structured output: the grammar matcher failed ({exc})"
    return False
