"""One call on a GPU: `python -m batchrun.gpucheck --json out.json` (a few minutes on one GPU).

1. The kernel benchmark (batchrun.kernels.bench): decode attention per KV dtype against the copy ceiling.
2. The model end to end on CUDA with kv_cache_dtype float16, int8 and fp8 and no kv_cache_memory (the pool sized
   from the profiled step): the pool (GiB, blocks, tokens), output tok/s, greedy outputs against a CPU float32 run
   of the same prompts (identical fraction), the step time split (forward, sampler, scheduler, the rest) and peak
   device memory against the device total.

`--dry-run` runs the same code on the CPU at small sizes (the kernels under TRITON_INTERPRET) to check it without a
GPU; its figures are not measurements.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch

KV_DTYPES = ("float16", "int8", "fp8")


class StepSplit:
    """Wraps the engine's forward, sampler and scheduler calls with timers (synchronising the device first, so a
    forward's time is not billed to the sampler that waits for it)."""

    def __init__(self, engine):
        self.seconds = {"forward": 0.0, "sampler": 0.0, "scheduler": 0.0}
        self.device = engine.device
        engine.runner.run = self._timed("forward", engine.runner.run)
        engine.sampler = self._timed("sampler", engine.sampler)
        engine.scheduler.schedule = self._timed("scheduler", engine.scheduler.schedule)
        engine.scheduler.update = self._timed("scheduler", engine.scheduler.update)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, part: str, fn):
        def call(*args, **kwargs):
            self._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.seconds[part] += time.perf_counter() - start
        return call

    def shares(self, total: float) -> dict:
        # 6 places: a part of a few hundred microseconds in a loaded step must not round to 0
        parts = {k: round(v / total, 6) for k, v in self.seconds.items()}
        return parts | {"rest": round(1 - sum(parts.values()), 6), "step_s_total": round(total, 3)}


def sample_prompts(n: int, max_chars: int | None = None) -> list[list[dict]]:
    """The first n prompts of the sample set (run from a checkout), as chat messages."""
    import pyarrow.parquet as pq
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prompts = pq.read_table(os.path.join(here, "sample_data", "prompts.parquet"), columns=["prompt"])
    return [[{"role": "user", "content": p[:max_chars]}] for p in prompts.column("prompt").to_pylist()[:n]]


def run_model(model: str, prompts, max_tokens: int, device: str, **options) -> tuple[dict, list[list[int]]]:
    from batchrun import LLM, SamplingParams
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    llm = LLM(model=model, device=device, **options)
    engine = llm.engine
    split = StepSplit(engine)
    steps_before = engine.stats.step
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    wall = time.perf_counter() - start
    failed = [o.error for o in outs if o.finish_reason == "error"]
    if failed:
        raise SystemExit(f"gpucheck: {len(failed)} of {len(outs)} prompts failed on {device}: {failed[0]}")
    tokens = sum(len(o.token_ids) for o in outs)
    pool_tokens = engine.num_blocks * engine.config.block_size
    report = {"kv_cache_dtype": options.get("kv_cache_dtype", "auto"), "compute_dtype": str(engine.dtype),
              "pool": {"blocks": engine.num_blocks, "block_size": engine.config.block_size, "tokens": pool_tokens,
                       "gib": round(pool_tokens * engine.kv_bytes_per_token / 2**30, 3),
                       "bytes_per_token": engine.kv_bytes_per_token},
              "output_tokens": tokens, "wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 1),
              "steps": engine.stats.step - steps_before, "step_split": split.shares(sum(split.seconds.values()) or 1)}
    if device == "cuda":
        report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        report["device_total_gib"] = round(torch.cuda.mem_get_info()[1] / 2**30, 3)
    else:
        report["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    del llm, engine
    return report, [o.token_ids for o in outs]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU at small sizes: checks the script, measures "
                                                          "nothing")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-memory", help="only for --dry-run (default there: 64MiB); on CUDA the pool is "
                                              "always profiled")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpucheck: no CUDA device is visible; use --dry-run to check the script on the CPU")
    from batchrun.kernels import bench
    kernels = bench.main(["--skip-e2e", *(["--dry-run"] if args.dry_run else [])])
    device = "cpu" if args.dry_run else "cuda"
    options = {"kv_cache_memory": args.kv_cache_memory or "64MiB"} if args.dry_run else {}
    prompts = sample_prompts(args.prompts, 200 if args.dry_run else None)   # a dry run's model may be tiny
    reference, expected = run_model(args.model, prompts, args.max_tokens, "cpu", dtype="float32",
                                    kv_cache_memory=args.kv_cache_memory or "1GiB")
    runs = []
    for kv in KV_DTYPES:
        report, got = run_model(args.model, prompts, args.max_tokens, device, kv_cache_dtype=kv, **options)
        report["identical_to_cpu_float32"] = round(sum(a == b for a, b in zip(got, expected)) / len(expected), 3)
        runs.append(report)
        print(f"{kv:>8}: pool {report['pool']['gib']} GiB ({report['pool']['tokens']} tokens), "
              f"{report['output_tok_s']} tok/s, identical to CPU float32 {report['identical_to_cpu_float32']:.0%}, "
              f"split {report['step_split']}")
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
              "dry_run": args.dry_run, "model": args.model, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "kernels": kernels, "cpu_float32_reference": reference, "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
