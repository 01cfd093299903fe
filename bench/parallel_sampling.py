"""n samples per prompt vs n separate requests, on SmolLM2: prompt tokens computed and peak KV blocks.

    python bench/parallel_sampling.py [--n 8] [--prompts 4] [--min-prompt-tokens 512] [--max-tokens 32]

The same prompts (sample_data/prompts.parquet, those of at least --min-prompt-tokens tokens), sampled at
temperature 0.8 either as SamplingParams(n=N) or as N copies of each prompt; with the prefix cache off (the copies
then share nothing) and on (copies admitted after the first prefill hit its cached blocks).
"""
import argparse
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from batchrun import LLM, SamplingParams
from batchrun.cpuinfo import cpu_model

PROMPTS = Path(__file__).resolve().parents[1] / "sample_data" / "prompts.parquet"


def run(llm, prompts, params) -> dict:
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, params)
    start, peak, before = time.perf_counter(), 0, engine.stats.prompt_tokens
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.stats.kv_blocks_used)
    return {"prompt_tokens": engine.stats.prompt_tokens - before, "peak_blocks": peak,
            "wall_s": time.perf_counter() - start}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--min-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prefix-cache", choices=["off", "on", "both"], default="both")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}")
    params = dict(max_tokens=args.max_tokens, temperature=0.8, seed=0, ignore_eos=True)
    for caching in {"off": [False], "on": [True], "both": [False, True]}[args.prefix_cache]:
        results = {}
        for name in ("n samples", "separate"):   # a fresh engine each: nothing cached from the other run
            llm = LLM(model="smollm2-135m", kv_cache_memory="1GiB", enable_prefix_caching=caching, max_num_seqs=64,
                      max_num_batched_tokens=2048)
            encoded = [llm.encode(p) for p in pq.read_table(PROMPTS).column("prompt").to_pylist()]
            prompts = [p for p in encoded if len(p) >= args.min_prompt_tokens][:args.prompts]
            if name == "n samples":
                results[name] = run(llm, prompts, SamplingParams(n=args.n, **params))
            else:
                results[name] = run(llm, [p for p in prompts for _ in range(args.n)], SamplingParams(**params))
        print(f"prefix cache {'on ' if caching else 'off'}: prompts of {[len(p) for p in prompts]} tokens, block "
              f"{llm.engine.config.block_size}, {llm.engine.num_blocks} blocks in the pool, n={args.n}")
        for name, r in results.items():
            print(f"  {name:9s}: prompt tokens computed {r['prompt_tokens']:6d}, peak KV blocks {r['peak_blocks']:5d}, "
                  f"wall {r['wall_s']:.1f}s")
        forked, separate = results["n samples"], results["separate"]
        print(f"  ratio: {separate['prompt_tokens'] / forked['prompt_tokens']:.2f}x fewer prompt tokens, "
              f"{separate['peak_blocks'] / forked['peak_blocks']:.2f}x fewer peak blocks")


if __name__ == "__main__":
    main()
