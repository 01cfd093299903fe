"""KV capacity at a fixed budget: bytes/token, tokens held and concurrently resident requests per KV dtype.

    python bench/kv_capacity.py [--budget 2GiB] [--repeat 20] [--data sample_data/prompts.parquet] [--json out.json]

No model forward. For float32/float16/int8/fp8 the pool is sized as the engine sizes it (budget // block bytes,
scales included). Concurrency on the sample mix (each row repeated --repeat times, every request running to its
max_tokens) is measured three ways, each over the steps where the waiting queue is non-empty:
  paged          the real Scheduler + BlockManager with a fake forward (blocks grow as tokens are computed;
                 preemption and recompute as in the engine)
  naive prompt   each request reserves prompt + max_tokens up front (token-exact, no fragmentation: an upper bound
                 for a contiguous allocator)
  naive max ctx  each request reserves the model's max context up front
Prefix caching is off: the repeated rows would otherwise share blocks, an artefact of the repetition.
"""
import argparse
import json
import statistics

import pyarrow.parquet as pq

from batchrun.config import parse_memory
from batchrun.engine import kv_cache, loader
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.request import Request
from batchrun.engine.scheduler import Scheduler
from batchrun.sampling_params import SamplingParams
from batchrun.stepmodel.simulate import fake_forward

DTYPES = ("float32", "float16", "int8", "fp8")
TOKEN_TARGET = 1.85        # int8/fp8 tokens vs float16
CONCURRENCY_TARGET = 2.0   # paged vs per-request reservation


class ReservingBlockManager(BlockManager):
    """A request's first allocation reserves `reserve(request)` tokens at once, so it never grows or is preempted."""

    def __init__(self, num_tokens: int, reserve):
        super().__init__(num_tokens, block_size=1, enable_prefix_caching=False)
        self.reserve = reserve

    def allocate_slots(self, request, num_new_tokens, computed_blocks=()):
        if not request.block_table:
            num_new_tokens = max(num_new_tokens, self.reserve(request) - request.num_computed_tokens)
        return super().allocate_slots(request, num_new_tokens, computed_blocks)


def simulate(block_manager, rows, repeat, max_num_batched_tokens):
    """Drive the scheduler with a fake forward; running-request counts over the steps where requests wait."""
    scheduler = Scheduler.single_lane(block_manager, max_num_seqs=100_000, max_num_batched_tokens=max_num_batched_tokens)
    for r in range(repeat):
        for i, (ids, max_tokens) in enumerate(rows):
            scheduler.add(Request(f"{r}-{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0)))
    running = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        if scheduler.num_waiting:
            running.append(len(scheduler.running))
        fake_forward(scheduler, plan)
    if not running:
        raise SystemExit("no request ever waited: the pool holds the whole queue; raise --repeat")
    return dict(peak=max(running), mean=statistics.fmean(running), steps=len(running),
                preemptions=scheduler.num_preemptions)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="2GiB", help="KV budget (default 2GiB)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="sample_data/prompts.parquet")
    ap.add_argument("--repeat", type=int, default=20, help="times the sample set is queued, so the pool fills")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=65536,
                    help="token budget per step; large so KV, not the budget, limits concurrency")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    budget = parse_memory(args.budget, "--budget")
    path = loader.resolve_model_path(args.model)
    config = loader.load_config(path)
    tokenizer = loader.load_tokenizer(path)
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    max_context = config.max_position_embeddings
    table = pq.read_table(args.data).to_pydict()
    all_rows = [(tokenizer(p).input_ids, int(m)) for p, m in zip(table["prompt"], table["max_tokens"])]
    rows = [(ids, m) for ids, m in all_rows if len(ids) + m <= max_context]
    lengths = [len(ids) + m for ids, m in rows]
    print(f"model {args.model}: {layers} layers, {kv_heads} KV heads, head_dim {head_dim}, max context {max_context}")
    print(f"budget {budget / 2**30:.3f} GiB; sample mix: {len(rows)} rows x {args.repeat} "
          f"({len(all_rows) - len(rows)} dropped: prompt + max_tokens over the max context), "
          f"mean prompt + max_tokens {statistics.fmean(lengths):.1f}, longest {max(lengths)}")

    results = []
    for name in DTYPES:
        bpt = kv_cache.bytes_per_token(layers, kv_heads, head_dim, kv_cache.storage_dtype(name, None))
        tokens = budget // (bpt * args.block_size) * args.block_size
        paged = simulate(BlockManager(tokens // args.block_size, args.block_size, enable_prefix_caching=False),
                         rows, args.repeat, args.max_num_batched_tokens)
        naive = simulate(ReservingBlockManager(tokens, lambda r: r.num_prompt_tokens + r.params.max_tokens),
                         rows, args.repeat, args.max_num_batched_tokens)
        results.append(dict(dtype=name, bytes_per_token=bpt, tokens=tokens, paged=paged, naive_prompt=naive,
                            naive_max_context=tokens // max_context))
    fp16 = next(r for r in results if r["dtype"] == "float16")
    for r in results:
        r["tokens_vs_float16"] = r["tokens"] / fp16["tokens"]
        r["paged_vs_naive_prompt"] = r["paged"]["mean"] / r["naive_prompt"]["mean"]
        r["paged_vs_naive_max_context"] = r["paged"]["mean"] / r["naive_max_context"]

    print(f"\n{'dtype':<9}{'B/token':>9}{'tokens':>9}{'vs f16':>8}{'paged peak':>12}{'mean':>8}{'preempt':>9}"
          f"{'naive p+m peak':>16}{'mean':>8}{'naive ctx':>11}{'paged/p+m':>11}{'paged/ctx':>11}")
    for r in results:
        p, n = r["paged"], r["naive_prompt"]
        print(f"{r['dtype']:<9}{r['bytes_per_token']:>9}{r['tokens']:>9}{r['tokens_vs_float16']:>7.3f}x"
              f"{p['peak']:>12}{p['mean']:>8.1f}{p['preemptions']:>9}{n['peak']:>16}{n['mean']:>8.1f}"
              f"{r['naive_max_context']:>11}{r['paged_vs_naive_prompt']:>10.2f}x"
              f"{r['paged_vs_naive_max_context']:>10.2f}x")

    print("\ntargets (concurrency ratios use the mean running requests while requests wait):")
    for r in results:
        if r["dtype"] in ("int8", "fp8"):
            ok = r["tokens_vs_float16"] >= TOKEN_TARGET
            print(f"  {r['dtype']} tokens {r['tokens_vs_float16']:.3f}x float16 (>= {TOKEN_TARGET}x): "
                  f"{'PASS' if ok else 'FAIL'}")
    for r in results:
        for key, label in (("paged_vs_naive_prompt", "prompt + max_tokens"),
                           ("paged_vs_naive_max_context", "max context")):
            ok = r[key] >= CONCURRENCY_TARGET
            print(f"  {r['dtype']} paged concurrency {r[key]:.2f}x reservation of {label} (>= {CONCURRENCY_TARGET}x): "
                  f"{'PASS' if ok else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, budget_bytes=budget, repeat=args.repeat, block_size=args.block_size,
                           max_context=max_context, results=results), f, indent=2)


if __name__ == "__main__":
    main()
