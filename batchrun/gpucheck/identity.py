"""Greedy outputs on the device against a CPU float32 run of the same prompts (the tiny sharp model): float32
compute with float32, float16, int8 and fp8 KV, so that only the device and the KV storage differ."""
from __future__ import annotations

from batchrun.gpucheck import models, workload
from batchrun.gpucheck.engine_run import run_engine

KV_DTYPES = ("float32", "float16", "int8", "fp8")
# The tiny model's KV is 1 KiB a token or less: a fixed pool on both devices (a profiled one on an H200 would be
# millions of blocks, whose books alone take seconds to build).
KV_MEMORY = "64MiB"
PROMPT_TOKENS, PROMPT_SEED = 48, 2


def sharp_prompts(count: int) -> list[list[int]]:
    """The identity prompts: on these the tiny sharp model's greedy choices win by >= 5e-4 in the logits over 64
    tokens (tests/test_gpucheck_models.py), far above float32's rounding (about 1e-5 on logits of size 10)."""
    vocab_size = models.SHAPES["tiny-sharp"][0]["vocab_size"]
    return workload.random_prompts(count, PROMPT_TOKENS, vocab_size, seed=PROMPT_SEED)


def compare(reference: list, got: list) -> dict:
    """How far two runs' greedy outputs agree: the fraction of requests identical, the mean fraction of tokens
    before the first difference, and the largest |logprob difference| over the tokens both chose alike."""
    if len(reference) != len(got):
        raise ValueError(f"compare: {len(reference)} reference outputs against {len(got)}")
    identical, prefix_share, worst = 0, 0.0, 0.0
    for ref, out in zip(reference, got):
        same = next((i for i, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b),
                    min(len(ref.token_ids), len(out.token_ids)))
        identical += ref.token_ids == out.token_ids
        prefix_share += same / max(len(ref.token_ids), 1)
        if ref.logprobs is not None and out.logprobs is not None:
            worst = max([worst] + [abs(a - b) for a, b in zip(ref.logprobs[:same], out.logprobs[:same])])
    n = len(reference)
    return {"identical": round(identical / n, 4), "mean_prefix_share": round(prefix_share / n, 4),
            "max_logprob_diff": worst}


def identity(model: str, device: str, prompts: list[list[int]], max_tokens: int, max_model_len: int) -> dict:
    common = dict(dtype="float32", max_model_len=max_model_len, max_num_seqs=len(prompts), kv_cache_memory=KV_MEMORY)
    reference_report, reference = run_engine(model, prompts, max_tokens, "cpu", logprobs=True,
                                             attention_backend="torch", **common)
    runs = []
    for kv in KV_DTYPES:
        report, got = run_engine(model, prompts, max_tokens, device, logprobs=True, kv_cache_dtype=kv, **common)
        runs.append({"kv_cache_dtype": kv, **compare(reference, got), "wall_s": report["wall_s"]})
    return {"model": model, "prompts": len(prompts), "max_tokens": max_tokens,
            "reference": {"device": "cpu", "dtype": "float32", "wall_s": reference_report["wall_s"]},
            "device_runs": runs}
