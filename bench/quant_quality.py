"""Quality of each precision choice (weights x KV) against 16-bit float weights and KV, as `batchrun kvcheck`
measures it, for the README's table.

    python bench/quant_quality.py [--model smollm2-135m] [--requests 32] [--max-tokens 64]
                                  [--configs float32,int8,int8-w8a16,fp8,int4,kv-int8,kv-fp8] [--json out.json]
                                  [--compute bfloat16|float32]

The first --requests sample articles (sample_data/prompts.parquet, chat template off: the raw text) run greedy for
--max-tokens tokens (EOS ignored) in deterministic mode, once on the reference (bfloat16 compute, float weights,
16-bit KV) and once per config: `float32` (float32 compute: the spread between two float precisions), a weight
format of engine.quantization on bfloat16 compute (int8 = W8A8, int8-w8a16, fp8 emulated on the CPU, int4;
`W:none` or `W:hadamard` sets engine.quantization_rotation, default auto; `W+head` engine.quantization_lm_head),
or `kv-int8` / `kv-fp8` (float weights, an 8-bit KV cache). Per config: the share of greedy outputs identical to the
reference over all --max-tokens, the first difference, and teacher-forced figures no early divergence cuts short:
the articles' log-likelihood per token on each side, its drop, and the mean |d logprob| position by position.

--compute float32 runs the reference and every weight or KV config at float32 compute (what `dtype: auto` picks
on a CPU without native bfloat16): the figures are then the format's own error, without bfloat16's rounding,
which alone changes most 64-token greedy outputs. Its spread config is then `bfloat16` (bfloat16 compute).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sample_data", "prompts.parquet")
CONFIGS = ("float32", "int8", "int8-w8a16", "fp8", "int4", "kv-int8", "kv-fp8")


def engine_options(config: str, compute: str = "bfloat16") -> dict:
    if config == "reference":
        return {"dtype": compute}
    if config in ("float32", "bfloat16"):   # the spread between two float precisions
        return {"dtype": config}
    if config.startswith("kv-"):
        return {"dtype": compute, "kv_cache_dtype": config[3:]}
    config, head, _ = config.partition("+head")   # int8+head -> engine.quantization_lm_head
    quantization, _, rotation = config.partition(":")   # int8:none -> engine.quantization_rotation none
    return {"dtype": compute, "quantization": quantization, "quantization_rotation": rotation or "auto",
            "quantization_lm_head": bool(head)}


def run(model: str, config: str, prompts: list[str], max_tokens: int, compute: str) -> list:
    from batchrun import LLM, SamplingParams
    llm = LLM(model=model, deterministic=True, kv_cache_memory="256MiB", max_model_len=2048,
              **engine_options(config, compute))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=True,
                            prompt_logprobs=True)
    outputs = llm.generate([llm.encode(p) for p in prompts], params, use_tqdm=False)
    del llm
    gc.collect()
    return outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json")
    ap.add_argument("--compute", choices=("bfloat16", "float32"), default="bfloat16",
                    help="compute dtype of the reference and of every weight / KV config")
    args = ap.parse_args()
    import pyarrow.parquet as pq

    from batchrun.cpuinfo import cpu_flags, cpu_model
    from batchrun.kvcheck import compare
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2")))
    print(f"CPU: {cpu_model()}; flags: {' '.join(flags)}; cores {os.cpu_count()}", flush=True)
    prompts = pq.read_table(SAMPLE).column("prompt").to_pylist()[:args.requests]
    start = time.perf_counter()
    reference = run(args.model, "reference", prompts, args.max_tokens, args.compute)
    scored = sum(len(o.prompt_logprobs) - 1 for o in reference)
    print(f"reference: {args.compute}, float weights, 16-bit KV; {len(prompts)} articles, {scored} scored prompt "
          f"tokens, {args.max_tokens} greedy tokens each ({time.perf_counter() - start:.0f} s)", flush=True)
    print("| config | greedy identical | first difference | log-likelihood / token (ref) | drop | mean abs d logprob |")
    print("|---|---|---|---|---|---|")
    rows = []
    for config in args.configs.split(","):
        outputs = run(args.model, config, prompts, args.max_tokens, args.compute)
        report = compare(reference, outputs, "", args.compute, config)
        first = "-" if report.mean_first_diff is None else f"{report.mean_first_diff:.1f}"
        print(f"| {config} | {report.identical_fraction:.0%} | {first} | {report.prompt_loglik:.4f} "
              f"({report.reference_prompt_loglik:.4f}) | {report.loglik_drop:+.4f} | "
              f"{report.mean_abs_prompt_logprob_diff:.4f} |", flush=True)
        rows.append({"config": config, **report.as_dict()})
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "flags": flags, "model": args.model, "compute": args.compute,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
