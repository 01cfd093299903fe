"""Tensor parallelism on the CPU (gloo) and as the planner predicts it on GPUs.

Part 1: a ~0.3B Llama shape with random weights (hidden 1024, 16 layers, 16 heads / 4 KV heads, intermediate 4096,
vocab 32000, float32), TP 1 vs TP 2 over this machine's cores (each rank gets half of them): wall time of a fixed
batch (prefill then decode), forward time (stats.forward_s, rank 0), and the share of the forward rank 0 spends in
collectives (the all-reduces and the logits gather, waiting for the other rank included), with peak RSS per rank.
On 2 cores no speed-up is expected: both ranks share the cores one process had. The first generate compiles
(untimed).

Part 2: the planner's step-time model for a 70B Llama (Llama 3 70B shape) on H100 and H200 at TP 1/2/4/8: weights
per GPU, a decode step of 64 sequences at 1,000 tokens of context, a 2,048-token prefill step, and the all-reduce
share of each.

    python bench/tp.py [--compile graph|ops|0] [--prompts 8] [--prompt-len 128] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def make_model(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                         intermediate_size=4096, vocab_size=32000, max_position_embeddings=2048,
                         tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def run_one(path: str, tp: int, args) -> dict:
    """One engine in this process (called in a fresh interpreter per run: one TP engine per process); --threads:
    rank 0's torch threads (TP 1 at one rank's share of the cores: the same per-rank compute as TP 2)."""
    import torch

    from batchrun import LLM, SamplingParams
    from batchrun.engine.parallel import group
    llm = LLM(model=path, dtype="float32", kv_cache_memory="1GiB", max_num_batched_tokens=1024,
              tensor_parallel_size=tp)
    if args.threads:
        torch.set_num_threads(args.threads)
    pids = [os.getpid()] + [w.process.pid for w in getattr(llm.engine.runner, "workers", [])]
    prompts = [[(7 * i + 13 * j) % 31990 + 5 for j in range(args.prompt_len)] for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)   # compiles (graph / ops), warms oneDNN
    forward = 0.0

    def add(stats):
        nonlocal forward
        forward += stats.forward_s
    llm.engine.observe(add)
    comm0 = group.Comm.seconds
    start = time.perf_counter()
    outs = llm.generate([[5] + p for p in prompts], params, use_tqdm=False)   # no prefix-cache hits
    wall = time.perf_counter() - start
    comm = group.Comm.seconds - comm0
    result = {"tp": tp, "wall_s": round(wall, 3), "forward_s": round(forward, 3), "collectives_s": round(comm, 3),
              "collective_share_of_forward": round(comm / forward, 3) if forward else None,
              "output_tokens": sum(len(o.token_ids) for o in outs), "threads_per_rank": torch.get_num_threads(),
              "peak_rss_mib_per_rank": [round(peak_rss_mib(p)) for p in pids],
              "first_tokens": outs[0].token_ids[:8]}
    llm.close()
    return result


def planner_table() -> list[str]:
    from batchrun.engine.step_stats import StepShape
    from batchrun.planner.plan import kv_bytes_per_token
    from batchrun.stepmodel.catalog import load_catalog
    from batchrun.stepmodel.costmodel import ModelSpec, RooflineModel
    m = ModelSpec.from_config(dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                                   num_hidden_layers=80, intermediate_size=28672, vocab_size=128256,
                                   max_position_embeddings=8192), "llama3-70b")
    decode, prefill = StepShape(64, 64, 64 * 1000, 64 * 1000), StepShape(2048, 1, 2048, 2048 * 2049 // 2)
    lines = [f"{'gpu':<11}{'TP':>3}{'wts GB/GPU':>11}{'fits 90%':>9}{'decode ms':>10}{'allred %':>9}"
             f"{'prefill ms':>11}{'allred %':>9}"]
    catalog = load_catalog()
    for name in ("H100-80GB", "H200-141GB"):
        gpu = catalog[name]
        for tp in (1, 2, 4, 8):
            cost = RooflineModel(m, gpu, kv_bytes_per_token(m, "float16"), tp=tp)
            fits = m.weight_bytes / tp < 0.9 * gpu.memory_bytes
            cells = []
            for shape in (decode, prefill):
                t = cost.step_time(shape)
                cells.append(f"{t * 1e3:>10.2f}{cost.allreduce_time(shape) / t * 100:>9.1f}")
            lines.append(f"{name:<11}{tp:>3}{m.weight_bytes / tp / 1e9:>11.1f}{'yes' if fits else 'no':>9}"
                         + "".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", default="graph", choices=["graph", "ops", "0"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "batchrun-bench-tp-llama-0.3b"))
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)   # internal: run one TP size, print JSON
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.model_dir, args.one, args)))
        return
    from batchrun.cpuinfo import cpu_flags, cpu_model
    print(f"cpu: {cpu_model()}; flags: {' '.join(sorted(f for f in cpu_flags() if f.startswith(('avx', 'amx'))))}")
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    make_model(args.model_dir)
    env = dict(os.environ, BATCHRUN_COMPILE={"graph": "1"}.get(args.compile, args.compile))
    print(f"0.3B Llama, float32, {args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} output "
          f"tokens each, BATCHRUN_COMPILE={env['BATCHRUN_COMPILE']}")
    results = []
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    for tp, threads in ((1, None), (1, half), (2, None)):
        cmd = [sys.executable, __file__, "--one", str(tp), "--model-dir", args.model_dir, "--prompts",
               str(args.prompts), "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens)]
        out = subprocess.run(cmd + (["--threads", str(threads)] if threads else []), env=env, capture_output=True,
                             text=True)
        line = next((li for li in out.stdout.splitlines() if li.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"TP {tp} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(line[7:]))
        print(json.dumps(results[-1]))
    one, one_half, two = results
    print(f"TP 2 / TP 1 wall: {two['wall_s'] / one['wall_s']:.2f}x (TP 1 on all cores), "
          f"{two['wall_s'] / one_half['wall_s']:.2f}x (TP 1 on one rank's {half} cores); rank 0 in collectives: "
          f"{two['collective_share_of_forward'] * 100:.1f}% of its forward; same first tokens: "
          f"{one['first_tokens'] == two['first_tokens']}")
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print("\nplanner, llama3-70b fp16 weights, decode 64 seqs x 1000 context, prefill 2048 tokens:")
    print("\n".join(planner_table()))


if __name__ == "__main__":
    main()
