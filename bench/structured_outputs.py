"""Cost of structured outputs: output tok/s with a JSON schema vs without, on SmolLM2 at batch 32.

    python bench/structured_outputs.py [--batch 32] [--max-tokens 64] [--reps 3]

The same chat prompts (sample_data/prompts.parquet) with and without a schema whose answer runs long (a free
string field), so that both runs decode about as many tokens; runs alternate, the median of each is reported, with
the time spent filling and applying the token masks and advancing the matchers (measured around those calls).
"""
import argparse
import statistics
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from batchrun import LLM, SamplingParams
from batchrun.cpuinfo import cpu_model
from batchrun.structured import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"topic": {"enum": ["history", "science", "other"]},
                                           "summary": {"type": "string"}},
          "required": ["topic", "summary"], "additionalProperties": False}
PROMPTS = Path(__file__).resolve().parents[1] / "sample_data" / "prompts.parquet"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(model="smollm2-135m", kv_cache_memory="1GiB", max_num_seqs=args.batch, max_num_batched_tokens=2048)
    prompts = [[{"role": "user", "content": "Answer in JSON with a topic and a summary.\n\n" + p[:600]}]
               for p in pq.read_table(PROMPTS).column("prompt").to_pylist()[:args.batch]]
    mask_time = [0.0]
    mask = GrammarCompiler.mask

    def timed_mask(self, logits, matchers):
        start = time.perf_counter()
        mask(self, logits, matchers)
        mask_time[0] += time.perf_counter() - start

    GrammarCompiler.mask = timed_mask
    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}, dtype {llm.engine.dtype}, batch {args.batch}, "
          f"max_tokens {args.max_tokens}")
    results = {"free": [], "schema": []}
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
    for rep in range(args.reps):
        for name, extra in (("free", {}), ("schema", {"json_schema": SCHEMA})):
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, **extra)
            mask_time[0] = 0.0
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            results[name].append(tokens / wall)
            print(f"rep {rep} {name:6s}: {tokens} tokens in {wall:.2f}s = {tokens / wall:.1f} tok/s, "
                  f"mask {mask_time[0]:.3f}s ({100 * mask_time[0] / wall:.1f}% of the wall), "
                  f"finished by the grammar {sum(o.finish_reason == 'stop' for o in outs)}/{len(outs)}")
    free, schema = statistics.median(results["free"]), statistics.median(results["schema"])
    print(f"median: free {free:.1f} tok/s, schema {schema:.1f} tok/s: the schema costs {100 * (1 - schema / free):.1f}%")


if __name__ == "__main__":
    main()
