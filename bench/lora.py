"""LoRA adapters per row vs the base model alone, on SmolLM2: output tokens per second on the same prompts.

    python bench/lora.py [--prompts 64] [--prompt-tokens 128] [--max-tokens 64] [--adapters 4] [--rank 16]
                         [--repeats 2] [--one-core] [--core N]

Four rank-16 PEFT adapters on every projection (q/k/v/o, gate/up/down), made once with PEFT into
BATCHRUN_CACHE/bench-adapters; the rows spread evenly over them (row i under adapter i mod 4). The base figure is an
engine without adapters on the same prompts. Both engines are built and warmed up (the whole-model graph compiled)
before timing; the runs alternate, base first, --repeats times, and the best of each is reported (the machine may be
shared: the ratio within one run is the figure). Prompts are the sample prompts' first --prompt-tokens tokens.
--one-core: one torch thread, and tokens per CPU second beside the wall-clock figure (less sensitive to other
processes on a shared machine than wall time). --core N: run on CPU core N only (as `taskset -c N`; default: where
the OS puts it).
"""
import argparse
import dataclasses
import os
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

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


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process, output tokens)."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, time.process_time() - cpu, sum(len(o.token_ids) for o in outs)


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
    for repeat in range(args.repeats):
        for name, llm, params in (("base", base, plain), ("lora", lora, spread)):
            wall, cpu, tokens = timed(llm, prompts, params)
            best[name, "wall"] = max(best[name, "wall"], tokens / wall)
            best[name, "cpu"] = max(best[name, "cpu"], tokens / cpu)
            print(f"  run {repeat + 1} {name}: {tokens} output tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s "
                  f"({tokens / cpu:.1f} per CPU second)")
    for clock in ("wall", "cpu") if args.one_core else ("wall",):
        base_rate, lora_rate = best["base", clock], best["lora", clock]
        print(f"best ({clock}): base {base_rate:.1f} tok/s, {args.adapters} adapters {lora_rate:.1f} tok/s = "
              f"{lora_rate / base_rate:.2f}x base (goal >= 0.8x)")


if __name__ == "__main__":
    main()
