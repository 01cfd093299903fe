"""Decode throughput of weight formats loaded side by side in one process, their generate calls alternating round
by round, so that each round's ratio to bfloat16 is taken over the same minute of the machine.

    python bench/format_ab.py [--model llama-0.3b] [--formats bfloat16,int8,int8+head] [--rounds 10] [--compile]

Formats as bench/quantized.py names them (`W:rotation`, `W+head`, `W+kv-int8` too).

bench/quantized.py runs each format in its own process, one after the other, and reports memory and quality; on a
shared machine whose speed swings for minutes at a time, its int8 / bfloat16 ratio moved 1.43-1.66x between two
runs of the same code. Here: the same workload (--requests prompts of 16 tokens, greedy, --max-tokens each,
EOS ignored), every format warmed up first, then --rounds rounds, each running every format once in a rotated order.
Prints the CPU, each format's median and best tok/s, and per format the median of the per-round ratios to the first
format, with the smallest and largest; greedy tokens are compared to the first format's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import quantized  # noqa: E402  (bench/quantized.py: the 0.3B model and the formats' engine options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-0.3b")
    ap.add_argument("--formats", default="bfloat16,int8,int8+head", help="the first is the baseline")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="the whole-model graph (default: BATCHRUN_COMPILE=ops)")
    args = ap.parse_args()
    os.environ["BATCHRUN_COMPILE"] = "1" if args.compile else "ops"
    import torch

    from batchrun import LLM, SamplingParams
    from batchrun.cpuinfo import cpu_flags, cpu_model
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx_vnni", "avx2")))
    print(f"CPU: {cpu_model()}; flags: {' '.join(flags)}; cores {os.cpu_count()}", flush=True)
    model = quantized.llama_03b() if args.model == "llama-0.3b" else args.model
    formats = args.formats.split(",")
    engines = {fmt: LLM(model=model, **quantized.engine_options(fmt, args.requests)) for fmt in formats}
    torch.manual_seed(0)
    prompts = [torch.randint(10, 30000, (16,)).tolist() for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    tokens, rates = {}, {fmt: [] for fmt in formats}
    for llm in engines.values():
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    for r in range(args.rounds):
        for fmt in formats[r % len(formats):] + formats[:r % len(formats)]:
            start = time.perf_counter()
            outputs = engines[fmt].generate(prompts, params, use_tqdm=False)
            rates[fmt].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
            tokens[fmt] = [o.token_ids for o in outputs]
    base = formats[0]
    for fmt in formats:
        ratios = [a / b for a, b in zip(rates[fmt], rates[base])]
        same = sum(a == b for a, b in zip(tokens[fmt], tokens[base]))
        print(f"{fmt:12s} median {statistics.median(rates[fmt]):7.1f} tok/s, best {max(rates[fmt]):7.1f}; "
              f"per-round ratio to {base}: median {statistics.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}); greedy identical to {base}: {same}/{len(prompts)}; "
              f"rounds {[round(x, 1) for x in rates[fmt]]}", flush=True)


if __name__ == "__main__":
    main()
