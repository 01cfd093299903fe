"""Output tok/s per KV dtype with every request admitted at once, the pool sized as the run's device sizes it
(profiled on CUDA), and each 8-bit dtype's capacity and speed against float16."""
from __future__ import annotations

from batchrun.gpucheck.engine_run import run_engine

KV_DTYPES = ("float16", "int8", "fp8")
GOAL_CAPACITY, GOAL_SPEEDUP = 1.8, 1.5   # issue 29: 8-bit KV against float16


def throughput(model: str, device: str, prompts: list[list[int]], max_tokens: int, max_model_len: int,
               max_num_batched_tokens: int, kv_dtypes=KV_DTYPES, **options) -> dict:
    runs = []
    for kv in kv_dtypes:
        report, _ = run_engine(model, prompts, max_tokens, device, kv_cache_dtype=kv, max_model_len=max_model_len,
                               max_num_seqs=len(prompts), max_num_batched_tokens=max_num_batched_tokens, **options)
        runs.append(report)
    base = next((r for r in runs if r["kv_cache_dtype"] == "float16"), None)
    if base is not None:
        for r in runs:
            # tokens per GiB of pool: the budgets of two profiled runs differ a little
            r["capacity_vs_float16"] = round(base["pool"]["bytes_per_token"] / r["pool"]["bytes_per_token"], 3)
            r["tok_s_vs_float16"] = round(r["output_tok_s"] / base["output_tok_s"], 3)
    return {"model": model, "requests": len(prompts), "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts)),
            "max_tokens": max_tokens, "max_num_batched_tokens": max_num_batched_tokens,
            "goals": {"capacity_vs_float16": GOAL_CAPACITY, "tok_s_vs_float16": GOAL_SPEEDUP}, "runs": runs}
