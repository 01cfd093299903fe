"""The peer on the same device: transformers' own continuous batching (`model.generate_batch`, its paged-attention
path) on the same model, prompts and output length, greedy, EOS off.

generate_batch builds its manager per call (cache sized from free memory, CUDA graphs captured at its start), so
besides the call's wall time the throughput is also taken over the requests' own lifespans (first admitted to last
finished): that figure leaves its set-up out, as batchrun's leaves out the engine's construction and warm-up.
"""
from __future__ import annotations

import time

import torch

from batchrun.gpucheck.engine_run import free_device

# On the CPU (dry run) generate_batch would size its cache from the host's free memory (measured: 17 s of set-up
# for a 2-request toy call); a small fixed cache keeps the dry run short.
CPU_CACHE = dict(num_blocks=16, max_batch_tokens=256)


def transformers_peer(model: str, device: str, prompts: list[list[int]], max_tokens: int, dtype: str) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    from transformers.utils import is_flash_attn_2_available
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    if not hasattr(hf, "generate_batch"):
        return {"skipped": f"transformers {transformers.__version__} has no generate_batch"}
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(**(CPU_CACHE if device == "cpu" else {}))
    attn = hf.config._attn_implementation
    start = time.perf_counter()
    outs = hf.generate_batch(prompts, generation_config=config, continuous_batching_config=cb,
                             max_new_tokens=max_tokens)
    wall = time.perf_counter() - start
    results = list(outs.values())
    del hf, outs
    free_device(device)
    failed = [r.error for r in results if r.error is not None]
    if failed or len(results) != len(prompts):
        raise RuntimeError(f"generate_batch: {len(failed)} errors, {len(results)} of {len(prompts)} results; "
                           f"first error: {failed[0] if failed else None}")
    tokens = sum(len(r.generated_tokens) for r in results)
    first, last = min(r.lifespan[0] for r in results), max(r.lifespan[1] for r in results)
    return {"transformers": transformers.__version__, "method": "generate_batch", "dtype": dtype,
            # generate_batch runs paged|<this>, or switches to flash attention when a flash package is there
            "attn_implementation_loaded": attn, "flash_attn_2_available": is_flash_attn_2_available(),
            "requests": len(prompts), "max_tokens": max_tokens, "output_tokens": tokens,
            "wall_s": round(wall, 3), "output_tok_s_wall": round(tokens / wall, 1),
            "in_flight_s": round(last - first, 3), "output_tok_s": round(tokens / (last - first), 1)}
