"""Throughput benchmark: batchrun vs transformers `generate` with static batches, same prompts, same run.

    python bench/throughput.py [--data sample_data/prompts.parquet] [--limit 64] [--batch-sizes 8,16] [--json out.json]

Useful output tokens: batchrun -> sum(len(o.token_ids)); baseline -> each row's generated tokens truncated to its own
max_tokens and cut at its first EOS (inclusive). The compute ceiling is the best fp32 GEMM FLOP/s measured here;
batchrun's processed tokens/s x 2 x parameters is reported as a fraction of it.
"""
import argparse
import gc
import json
import time

import pyarrow.parquet as pq
import torch


def unique_params(model) -> int:
    """Parameters counted once per storage: a tied lm_head shares the embedding's tensor."""
    return sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())


def gemm_flops(reps=8):
    """Best sustained fp32 torch.mm FLOP/s over a square and a model-like (hidden 576 -> MLP 1536) shape."""
    best = 0.0
    for m, k, n in ((1024, 1024, 1024), (256, 576, 1536)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        inner = max(1, int(1e9 // (2 * m * k * n)))  # ~1 GFLOP per timed sample
        for _ in range(3):
            torch.mm(a, b)
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(inner):
                torch.mm(a, b)
            best = max(best, 2 * m * k * n * inner / (time.perf_counter() - t))
    return best


def run_batchrun(args, prompts, max_tokens):
    from batchrun import LLM, SamplingParams
    opts = {k: v for k, v in (("kv_cache_memory", args.kv_cache_memory), ("max_num_seqs", args.max_num_seqs),
                              ("max_num_batched_tokens", args.max_num_batched_tokens)) if v is not None}
    t = time.perf_counter()
    llm = LLM(model=args.model, **opts)
    load_s = time.perf_counter() - t
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=False) for m in max_tokens]
    llm.generate(["Hello"], [SamplingParams(max_tokens=4, temperature=0.0)], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    useful = sum(len(o.token_ids) for o in outs)
    res = dict(load_s=load_s, wall_s=wall, useful_tokens=useful, useful_tok_s=useful / wall,
               prompt_tokens=sum(o.prompt_tokens for o in outs),
               processed_tok_s=sum(o.prompt_tokens + len(o.token_ids) for o in outs) / wall,
               n_params=unique_params(llm.model),
               finish_reasons={r: sum(str(o.finish_reason) == r for o in outs) for r in {str(o.finish_reason) for o in outs}})
    model_path, ids = llm.model_path, [list(o.token_ids) for o in outs]
    del llm, outs
    gc.collect()
    return res, model_path, ids


def run_baseline(model, tok, eos_ids, prompts, max_tokens, bs):
    """Static batches in file order, left padded, greedy; each batch runs to its largest max_tokens."""
    rows = []
    with torch.inference_mode():  # warm-up
        model.generate(**tok(["Hello"], return_tensors="pt"), max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    t = time.perf_counter()
    for i in range(0, len(prompts), bs):
        mts = max_tokens[i:i + bs]
        enc = tok(prompts[i:i + bs], return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max(mts), do_sample=False, pad_token_id=tok.pad_token_id,
                                 eos_token_id=sorted(eos_ids))
        for seq, m in zip(out[:, enc.input_ids.shape[1]:].tolist(), mts):
            seq = seq[:m]
            cut = next((j + 1 for j, x in enumerate(seq) if x in eos_ids), len(seq))
            rows.append(seq[:cut])
    wall = time.perf_counter() - t
    useful = sum(map(len, rows))
    return dict(batch_size=bs, wall_s=wall, useful_tokens=useful, useful_tok_s=useful / wall), rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="sample_data/prompts.parquet")
    ap.add_argument("--limit", type=int, default=None, help="first N rows only (default: all)")
    ap.add_argument("--model", default="smollm2-135m", help="batchrun model name (a local HF dir with --skip-batchrun)")
    ap.add_argument("--batch-sizes", default="8,16", help="comma-separated static batch sizes for the baseline")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--skip-batchrun", action="store_true", help="baseline only; --model must then be a local HF dir")
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--kv-cache-memory", help="e.g. 2GiB (default: batchrun's)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if args.skip_baseline and args.skip_batchrun:
        ap.error("nothing to run: both --skip-baseline and --skip-batchrun given")

    table = pq.read_table(args.data).to_pydict()
    prompts, max_tokens = table["prompt"][:args.limit], [int(m) for m in table["max_tokens"][:args.limit]]
    n = len(prompts)
    print(f"rows: {n}  requested max_tokens: {sum(max_tokens)}  torch threads: {torch.get_num_threads()}")
    flops = gemm_flops()
    print(f"fp32 GEMM ceiling: {flops / 1e9:.1f} GFLOP/s")
    result = dict(rows=n, gemm_gflops=flops / 1e9, baseline=[])

    br_ids, model_path = None, args.model
    if not args.skip_batchrun:
        br, model_path, br_ids = run_batchrun(args, prompts, max_tokens)
        br["frac_of_ceiling"] = br["processed_tok_s"] * 2 * br["n_params"] / flops
        result["batchrun"] = br
        print(f"batchrun: {br['wall_s']:.1f}s  {br['useful_tok_s']:.1f} useful tok/s  (load {br['load_s']:.1f}s)")

    base_ids = None
    if not args.skip_baseline:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_path)
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        gen_eos = model.generation_config.eos_token_id
        eos_ids = {tok.eos_token_id} | set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            res, rows = run_baseline(model, tok, eos_ids, prompts, max_tokens, bs)
            result["baseline"].append(res)
            base_ids = base_ids or rows
            print(f"hf generate bs={bs}: {res['wall_s']:.1f}s  {res['useful_tok_s']:.1f} useful tok/s")
        if args.skip_batchrun:
            result["n_params"] = unique_params(model)

    print(f"\n{'engine':<22}{'wall s':>9}{'useful tok':>12}{'useful tok/s':>14}")
    if "batchrun" in result:
        br = result["batchrun"]
        print(f"{'batchrun':<22}{br['wall_s']:>9.1f}{br['useful_tokens']:>12}{br['useful_tok_s']:>14.1f}")
    for res in result["baseline"]:
        print(f"{'hf generate bs=' + str(res['batch_size']):<22}{res['wall_s']:>9.1f}{res['useful_tokens']:>12}"
              f"{res['useful_tok_s']:>14.1f}")
    if result["baseline"]:
        best = max(result["baseline"], key=lambda r: r["useful_tok_s"])
        result["best_baseline_batch_size"] = best["batch_size"]
        if "batchrun" in result:
            result["ratio_vs_best_baseline"] = br["useful_tok_s"] / best["useful_tok_s"]
            print(f"\nbatchrun / best baseline (bs={best['batch_size']}): {result['ratio_vs_best_baseline']:.2f}x")
    if "batchrun" in result:
        print(f"batchrun processed tokens/s: {br['processed_tok_s']:.1f} (prompt tokens {br['prompt_tokens']}, "
              f"params {br['n_params'] / 1e6:.1f}M) -> {br['processed_tok_s'] * 2 * br['n_params'] / 1e9:.1f} GFLOP/s "
              f"= {br['frac_of_ceiling']:.1%} of the {flops / 1e9:.1f} GFLOP/s GEMM ceiling")
        print(f"finish reasons: {br['finish_reasons']}")
    if br_ids is not None and base_ids is not None:
        k = min(8, n)
        same = sum(a == b for a, b in zip(br_ids[:k], base_ids[:k]))
        result["first_rows_identical"] = [same, k]
        print(f"greedy outputs token-identical to the baseline (bs={result['baseline'][0]['batch_size']}), "
              f"first {k} rows: {same}/{k}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
