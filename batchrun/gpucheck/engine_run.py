"""One timed engine run: greedy, every prompt to exactly max_tokens; its pool, memory, tok/s and step split."""
from __future__ import annotations

import gc
import resource
import time

import torch

from batchrun.gpucheck.step_split import StepSplit

GIB = 2**30


def _gib(n: float) -> float:
    return round(n / GIB, 3)


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's tensors, each storage once (tied embeddings share one)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total


def pool_bytes(engine) -> int:
    """Bytes of every lane's KV pool as allocated (8-bit pools: codes and scales)."""
    return sum(p.data.nbytes + (p.scales.nbytes if p.scales is not None else 0) for p in engine.runner.pools)


def free_device(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_engine(model: str, prompts: list[list[int]], max_tokens: int, device: str, logprobs: bool = False,
               warmup: bool = True, **options) -> tuple[dict, list]:
    """(report, outputs in prompt order). On CUDA the report has the memory figures: what was free before the
    engine, its weights, its pool and the pool's share of what the weights left free, the peaks."""
    from batchrun import LLM, SamplingParams
    free_device(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        free_before, total = torch.cuda.mem_get_info()
    llm = LLM(model=model, device=device, **options)
    engine = llm.engine
    if warmup:   # compiles the kernels; reversed prompts, so the timed run gets no prefix-cache hit from it
        llm.generate([p[::-1] for p in prompts[:2]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    steps_before, preempt_before = engine.stats.step, engine.stats.preemptions
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)
    with StepSplit(engine) as split:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    failed = [o.error for o in outs if o.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outs)} prompts failed on {device}: {failed[0]}")
    tokens = sum(len(o.token_ids) for o in outs)
    pool_tokens = engine.block_manager.num_blocks * engine.config.block_size
    report = {"kv_cache_dtype": options.get("kv_cache_dtype", "auto"), "compute_dtype": str(engine.dtype),
              "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "max_tokens": max_tokens,
              "pool": {"blocks": engine.block_manager.num_blocks, "block_size": engine.config.block_size,
                       "tokens": pool_tokens, "bytes_per_token": engine.kv_bytes_per_token,
                       "gib": _gib(pool_tokens * engine.kv_bytes_per_token),
                       "max_concurrency_at_max_len": pool_tokens // engine.max_model_len,
                       "max_model_len": engine.max_model_len},
              "output_tokens": tokens, "wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 1),
              "steps": engine.stats.step - steps_before, "preemptions": engine.stats.preemptions - preempt_before,
              "step_split": split.shares(sum(split.seconds.values()) or 1)}
    if device == "cuda":
        weights, pools = _weight_bytes(engine.model), pool_bytes(engine)
        report["memory"] = {
            "device_total_gib": _gib(total), "free_before_gib": _gib(free_before), "weights_gib": _gib(weights),
            "pools_gib": _gib(pools), "pool_share_of_free": round(pools / (free_before - weights), 4),
            "peak_allocated_gib": _gib(torch.cuda.max_memory_allocated()),
            "peak_reserved_gib": _gib(torch.cuda.max_memory_reserved()),
            "peak_reserved_share_of_total": round(torch.cuda.max_memory_reserved() / total, 4)}
    else:
        report["memory"] = {"peak_rss_gib": _gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}
    del llm, engine, split
    free_device(device)
    return report, outs
