"""`python -m batchrun.gpucheck`: the sections in order of value, each recorded in the JSON as it ends (a run
stopped from outside keeps what it finished), a failed section recorded as an error and the next one run."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace

import torch

from batchrun.gpucheck import identity, interactive, models, peer, summary, throughput, workload

SECTIONS = ("kernels", "identity", "throughput", "peer", "interactive", "throughput_smollm2")


@dataclass(frozen=True)
class Sizes:
    requests: int = 256                  # concurrent requests of the throughput, peer and interactive sections
    prompt_tokens: int = 1024            # their mean prompt length (+-25 %)
    max_tokens: int = 128
    max_num_batched_tokens: int = 8192
    identity_prompts: int = 32
    identity_tokens: int = 64
    interactive_requests: int = 16
    interactive_prompt_tokens: int = 128
    interactive_max_tokens: int = 32
    interactive_interval_s: float = 0.25
    batch_max_tokens: int = 1024         # the batch under the interactive requests outlasts them (then aborted)
    kv_cache_memory: str | None = None   # None: profiled (CUDA)


FULL = Sizes()
DRY = Sizes(requests=6, prompt_tokens=40, max_tokens=4, max_num_batched_tokens=64, identity_prompts=3,
            identity_tokens=8, interactive_requests=3, interactive_prompt_tokens=8, interactive_max_tokens=2,
            interactive_interval_s=0.05, batch_max_tokens=400, kv_cache_memory="4MiB")


def _kernels(dry_run: bool) -> dict:
    from batchrun.gpucheck import kernel_bench as bench
    return bench.main(["--skip-e2e", *(["--dry-run"] if dry_run else [])])


def _section_runners(args, sizes: Sizes, device: str, paths: dict[str, str]) -> dict:
    cfg = models.config("llama-1b", args.dry_run)
    prompts = workload.random_prompts(sizes.requests, sizes.prompt_tokens, cfg.vocab_size, seed=1)
    max_len = workload.max_len_for(prompts, sizes.max_tokens)
    memory = {"kv_cache_memory": sizes.kv_cache_memory} if sizes.kv_cache_memory else {}
    identity_prompts = identity.sharp_prompts(sizes.identity_prompts)
    small = models.config("smollm2-135m", args.dry_run)
    small_prompts = workload.random_prompts(sizes.requests, sizes.prompt_tokens, small.vocab_size, seed=3)
    peer_dtype = "float32" if device == "cpu" else "bfloat16"   # the engine's compute dtype for a bf16 checkpoint
    return {
        "kernels": lambda: _kernels(args.dry_run),
        "identity": lambda: identity.identity(paths["tiny-sharp"], device, identity_prompts, sizes.identity_tokens,
                                              workload.max_len_for(identity_prompts, sizes.identity_tokens)),
        "throughput": lambda: throughput.throughput(paths["llama-1b"], device, prompts, sizes.max_tokens, max_len,
                                                    sizes.max_num_batched_tokens, **memory),
        "peer": lambda: peer.transformers_peer(paths["llama-1b"], device, prompts, sizes.max_tokens, peer_dtype),
        "interactive": lambda: interactive.interactive_ttft(
            paths["llama-1b"], device, prompts,
            workload.random_prompts(sizes.interactive_requests, sizes.interactive_prompt_tokens, cfg.vocab_size,
                                    seed=4),
            sizes.interactive_interval_s, sizes.interactive_max_tokens, sizes.batch_max_tokens,
            sizes.max_num_batched_tokens, **memory),
        "throughput_smollm2": lambda: throughput.throughput(
            paths["smollm2-135m"], device, small_prompts, sizes.max_tokens,
            workload.max_len_for(small_prompts, sizes.max_tokens), sizes.max_num_batched_tokens,
            kv_dtypes=("float16", "int8"), **memory),
    }


def _write(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)


def main(argv: list[str] | None = None) -> dict:
    from batchrun.gpucheck import __doc__ as doc
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--json", help="write the results here (rewritten after each section)")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU at toy sizes: checks the code path, "
                                                          "measures nothing")
    ap.add_argument("--models", help="folder of the built models (made if missing; default: a temporary folder)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no section after this many seconds (the caller's own timeout stops a long one)")
    ap.add_argument("--requests", type=int, help="override the throughput sections' concurrent requests")
    ap.add_argument("--max-tokens", type=int, help="override the throughput sections' output tokens")
    args = ap.parse_args(argv)
    chosen = args.sections.split(",")
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"gpucheck: unknown section(s) {', '.join(unknown)}; allowed: {', '.join(SECTIONS)}")
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpucheck: no CUDA device is visible; use --dry-run to check the script on the CPU")
    if args.dry_run and not torch.cuda.is_available():
        # read when a Triton kernel is decorated, and building a model with transformers imports Triton: set it first
        os.environ["TRITON_INTERPRET"] = "1"
    start = time.perf_counter()
    sizes = DRY if args.dry_run else FULL
    sizes = replace(sizes, **{k: v for k, v in (("requests", args.requests), ("max_tokens", args.max_tokens)) if v})
    device = "cpu" if args.dry_run else "cuda"
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
              "dry_run": args.dry_run, "torch": torch.__version__, "sizes": asdict(sizes), "sections": {}}
    with tempfile.TemporaryDirectory(prefix="gpucheck-models-") as scratch:
        paths = models.build_all(args.models or scratch, toy=args.dry_run)
        runners = _section_runners(args, sizes, device, paths)
        for name in (s for s in SECTIONS if s in chosen):
            elapsed = time.perf_counter() - start
            if args.deadline_s is not None and elapsed > args.deadline_s:
                result["sections"][name] = {"skipped": f"deadline: {elapsed:.0f} s of {args.deadline_s:.0f} s spent"}
                continue
            section_start = time.perf_counter()
            print(f"gpucheck: {name} ...", flush=True)
            try:
                result["sections"][name] = runners[name]()
            except Exception as exc:   # recorded; the next section still runs
                result["sections"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                            "traceback": traceback.format_exc(limit=8)[-3000:]}
            result["sections"][name]["section_s"] = round(time.perf_counter() - section_start, 1)
            result["elapsed_s"] = round(time.perf_counter() - start, 1)
            _write(args.json, result)
    print(summary.summarize(result), flush=True)
    return result
