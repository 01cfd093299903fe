"""Throughput per KV dtype at a tight KV budget, where float16 KV limits the batch.

    python bench/kv_throughput.py [--kv-cache-memory 48MiB] [--dtypes float16,int8] [--limit 64] [--json out.json]

The same sample prompts (greedy, each row's max_tokens) run through one engine per dtype, one at a time, in this
process. max_model_len is lowered (default 2048; the sample set's longest prompt + max_tokens is 1606) so that the
tight budget passes the engine's one-request-at-max-context check. Reports output tokens/s, wall time, preemptions
and the peak and mean number of requests in each forward, then each dtype's tokens/s relative to float16, by wall
time and by this process's CPU time (less sensitive to other work on a shared machine).
A dtype whose pool cannot hold one request at max_model_len (float32 at 48MiB) is reported as skipped.
"""
import argparse
import gc
import json
import statistics
import time

import pyarrow.parquet as pq
import torch

from batchrun import LLM, SamplingParams


def run(args, dtype, prompts, max_tokens):
    try:
        llm = LLM(model=args.model, kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=dtype,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    except ValueError as e:
        return dict(dtype=dtype, skipped=str(e))
    engine = llm.engine
    llm.generate(["Hello"], [SamplingParams(max_tokens=4, temperature=0)], use_tqdm=False)  # warm-up
    ids = [llm.encode(p) for p in prompts]
    preemptions_before = engine.stats.preemptions
    start, cpu_start = time.perf_counter(), time.process_time()
    for prompt_ids, m in zip(ids, max_tokens):
        engine.add_request(prompt_ids, SamplingParams(max_tokens=m, temperature=0))
    in_forward, out_tokens = [], 0
    while engine.has_unfinished():
        finished = [o for o in engine.step() if o.finished]
        out_tokens += sum(len(o.token_ids) for o in finished)
        in_forward.append(engine.stats.running + len(finished))   # still running + finished in this step
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    res = dict(dtype=dtype, kv_tokens=engine.num_blocks * engine.config.block_size,
               kv_bytes_per_token=engine.kv_bytes_per_token, wall_s=wall, cpu_s=cpu, output_tokens=out_tokens,
               output_tok_s=out_tokens / wall, output_tok_per_cpu_s=out_tokens / cpu,
               preemptions=engine.stats.preemptions - preemptions_before,
               peak_running=max(in_forward), mean_running=statistics.fmean(in_forward), steps=len(in_forward))
    del llm, engine
    gc.collect()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="sample_data/prompts.parquet")
    ap.add_argument("--limit", type=int, default=64, help="first N rows (default 64)")
    ap.add_argument("--kv-cache-memory", default="48MiB", help="KV budget per engine (default 48MiB)")
    ap.add_argument("--dtypes", default="float16,int8", help="comma-separated kv_cache_dtype values")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    table = pq.read_table(args.data).to_pydict()
    prompts, max_tokens = table["prompt"][:args.limit], [int(m) for m in table["max_tokens"][:args.limit]]
    print(f"rows {len(prompts)}, requested max_tokens {sum(max_tokens)}, KV budget {args.kv_cache_memory}, "
          f"max_model_len {args.max_model_len}, max_num_seqs {args.max_num_seqs}, "
          f"torch threads {torch.get_num_threads()}")
    results = []
    for dtype in args.dtypes.split(","):
        results.append(run(args, dtype, prompts, max_tokens))
        r = results[-1]
        print(f"  {dtype}: " + (f"skipped: {r['skipped']}" if "skipped" in r else
                                f"{r['wall_s']:.1f}s, {r['output_tok_s']:.2f} output tok/s"), flush=True)

    base = next((r for r in results if r["dtype"] == "float16" and "skipped" not in r), None)
    print(f"\n{'dtype':<9}{'KV tokens':>10}{'B/token':>9}{'wall s':>9}{'out tok':>9}{'out tok/s':>11}{'preempt':>9}"
          f"{'peak run':>10}{'mean run':>10}{'cpu s':>9}{'vs f16':>8}{'vs f16 cpu':>11}")
    for r in results:
        if "skipped" in r:
            print(f"{r['dtype']:<9}skipped")
            continue
        if base:
            r["tok_s_vs_float16"] = r["output_tok_s"] / base["output_tok_s"]
            r["tok_per_cpu_s_vs_float16"] = r["output_tok_per_cpu_s"] / base["output_tok_per_cpu_s"]
        ratios = f"{r['tok_s_vs_float16']:>7.2f}x{r['tok_per_cpu_s_vs_float16']:>10.2f}x" if base else ""
        print(f"{r['dtype']:<9}{r['kv_tokens']:>10}{r['kv_bytes_per_token']:>9}{r['wall_s']:>9.1f}"
              f"{r['output_tokens']:>9}{r['output_tok_s']:>11.2f}{r['preemptions']:>9}{r['peak_running']:>10}"
              f"{r['mean_running']:>10.1f}{r['cpu_s']:>9.1f}{ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), results=results), f, indent=2)


if __name__ == "__main__":
    main()
