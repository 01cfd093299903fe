"""batchrun vs vLLM's CPU build (and transformers' static batching), same prompts, same run, side by side.

    python bench/vs_vllm.py [--model smollm2,mid] [--limit 32] [--dtypes float32,bfloat16] [--workloads sample,shared]
                            [--repeats 3] [--json out.json]

Models (bench/bench_models.py): tiny, smollm2 (SmolLM2-135M) and mid (a random ~0.3B Llama built once into the cache);
both engines load the same directory. Every (model, dtype, workload) cell is one row of one table.

Workloads, from sample_data/prompts.parquet (first --limit rows), as token ids built once and fed to every engine:
  sample  each row's prompt as a chat user message, the row's max_tokens
  shared  one long system prompt (about 1,000 tokens) shared by every row, then the row's prompt cut to 300 characters
Greedy, EOS ignored, each request its own max_tokens, prefix caching on everywhere; model load and compile excluded.
--repeats N times each workload N times in each engine, the prefix cache reset before each call, and keeps the
fastest (every call's time is printed): on a machine shared with other virtual machines one call can run 20 %
slower than the next.
vLLM runs in its own virtual environment (created by bench/setup_vllm.sh on first use; BATCHRUN_VLLM_VENV moves it)
with every core for compute (its default on a 2-core machine keeps one core for its engine process: add
--vllm-default-threads to measure that). The CPU model and its flags are printed with the figures. Where other jobs
share the machine, wall times swing with their load (2-thread OpenMP regions wait for a descheduled thread):
--one-core runs both engines on one thread pinned to core 0, vLLM in one process, and the CPU-time columns
(process_time over the timed generate) compare the work each engine does.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

import bench_models
from fastest_call import keep_fastest

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("BATCHRUN_VLLM_VENV", Path.home() / ".cache" / "batchrun" / "vllm-venv"))
WARM_UP = [[1, 2, 3], list(range(5, 45)), list(range(5, 25)) * 3]   # token ids; the last two share a prefix
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")


def workloads(tokenizer, data: str, limit: int, names: list[str]) -> dict:
    table = pq.read_table(data).to_pydict()
    texts, max_tokens = table["prompt"][:limit], [int(m) for m in table["max_tokens"][:limit]]

    def chat(messages):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    system = ("You are a meticulous analyst. Use the reference notes below when they help.\n\n"
              + "\n\n".join(sorted(table["prompt"], key=len)[-2:]))[:4200]
    built = {"sample": [chat([{"role": "user", "content": t}]) for t in texts],
             "shared": [chat([{"role": "system", "content": system}, {"role": "user", "content": t[:300]}])
                        for t in texts]}
    return {name: {"prompts": built[name], "max_tokens": max_tokens} for name in names}


def run_batchrun(model_path: str, dtype: str, work: dict, max_num_seqs: int, repeats: int = 1) -> dict:
    from batchrun import LLM, SamplingParams
    from step_split import StepSplit
    start = time.perf_counter()
    llm = LLM(model=model_path, dtype=dtype, max_num_seqs=max_num_seqs)
    # Warm-up: a batch of several lengths, so torch.compile's dynamic-shape kernels are built before timing.
    llm.generate(WARM_UP, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    result = dict(load_s=time.perf_counter() - start, workloads={})
    for _ in range(repeats):   # each workload's fastest call is kept, every call's time listed
        for name, w in work.items():
            params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in w["max_tokens"]]
            llm.reset_prefix_cache()   # every call starts as the first did: no prompt cached by an earlier one
            with StepSplit(llm.engine) as split:
                start, cpu = time.perf_counter(), time.process_time()
                outs = llm.generate(w["prompts"], params, use_tqdm=False)
                wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            ids = [list(o.token_ids) for o in outs]
            result["workloads"][name] = keep_fastest(result["workloads"].get(name), dict(
                wall_s=wall, cpu_s=cpu, output_tokens=sum(map(len, ids)), token_ids=ids, split=split.shares(wall)))
            print(f"batchrun {dtype} {name}: {wall:.1f}s", file=sys.stderr, flush=True)
    del llm
    return result


def run_vllm(model_path: str, dtype: str, work: dict, max_num_seqs: int, default_threads: bool,
             one_core: int | None, lora: dict | None = None, repeats: int = 1) -> dict:
    """vLLM's figures (vllm_worker.py's RESULT) in its own environment; `lora`: the worker's LoRA request key."""
    if not (VENV / "bin" / "python").exists():
        subprocess.run(["bash", str(ROOT / "bench" / "setup_vllm.sh"), str(VENV)], check=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}
    if one_core is not None:   # one compute thread, engine core and worker in one process: process_time is all work
        env.update(VLLM_CPU_OMP_THREADS_BIND=str(one_core), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")
    elif not default_threads:
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    with tempfile.TemporaryDirectory() as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps(dict(model=model_path, dtype=dtype, max_num_seqs=max_num_seqs, workloads=work,
                                           warm_up=WARM_UP, one_process=one_core is not None, lora=lora,
                                           repeats=repeats)))
        log = Path(tmp) / "vllm.log"
        with open(log, "w") as out:
            proc = subprocess.run([str(VENV / "bin" / "python"), str(ROOT / "bench" / "vllm_worker.py"),
                                   str(request), str(result)], env=env, stdout=out, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM worker failed (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
        return json.loads(result.read_text())


def run_transformers(model_path: str, work: dict, batch_size: int) -> dict:
    """Static batches in input order, left padded, greedy, EOS ignored, each row cut to its own max_tokens."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    config = model.generation_config
    config.eos_token_id = model.config.vocab_size   # an id never produced: run to max_new_tokens
    result = {}
    for name, w in work.items():
        rows, start = [], time.perf_counter()
        for i in range(0, len(w["prompts"]), batch_size):
            batch, mts = w["prompts"][i:i + batch_size], w["max_tokens"][i:i + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                     max_new_tokens=max(mts), do_sample=False, pad_token_id=0)
            rows += [seq[:m] for seq, m in zip(out[:, width:].tolist(), mts)]
        wall = time.perf_counter() - start
        result[name] = dict(wall_s=wall, output_tokens=sum(map(len, rows)), token_ids=rows)
        print(f"transformers bs={batch_size} {name}: {wall:.1f}s", file=sys.stderr, flush=True)
    return result


def identical(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def print_table(results: dict, work_names: list[str]) -> None:
    print(f"\n{'model':<14}{'dtype':<10}{'workload':<10}{'engine':<14}{'wall s':>8}{'out tok/s':>11}{'batchrun/x':>12}"
          f"{'same tokens':>13}{'cpu s':>8}{'tok/cpu-s':>11}{'batchrun/x':>12}")
    for model, runs in results["runs"].items():
        for dtype, run in runs.items():
            for name in work_names:
                ours = run["batchrun"]["workloads"][name]
                for engine in ("batchrun", "vllm", "transformers"):
                    res = run.get(engine, {}).get("workloads", run.get(engine, {})).get(name)
                    if res is None:
                        continue
                    tok_s = res["output_tokens"] / res["wall_s"]
                    ratio = ours["output_tokens"] / ours["wall_s"] / tok_s
                    same = "" if engine == "batchrun" else identical(ours["token_ids"], res["token_ids"])
                    cpu = ""
                    if results.get("one_core") is not None:   # else vLLM's work is in processes not counted
                        per_cpu = res["output_tokens"] / res["cpu_s"]
                        cpu = (f"{res['cpu_s']:>8.1f}{per_cpu:>11.1f}"
                               f"{ours['output_tokens'] / ours['cpu_s'] / per_cpu:>11.2f}x")
                    calls = res.get("wall_s_each", [])
                    each = f"  calls {' / '.join(f'{s:.1f}' for s in calls)} s" if len(calls) > 1 else ""
                    print(f"{model:<14}{dtype:<10}{name:<10}{engine:<14}{res['wall_s']:>8.1f}{tok_s:>11.1f}"
                          f"{ratio:>11.2f}x{same:>13}{cpu}{each}")
                print(f"{'':<34}batchrun step split: "
                      + ", ".join(f"{k} {v:.0%}" for k, v in ours["split"].items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "sample_data" / "prompts.parquet"))
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--model", default="smollm2,mid", help=f"comma-separated, of: {', '.join(bench_models.NAMES)}")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workloads", default="sample,shared")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true", help="the transformers baseline (float32, sample)")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--vllm-default-threads", action="store_true")
    ap.add_argument("--one-core", type=int, nargs="?", const=0, metavar="CORE",
                    help="both engines on one thread pinned to CORE (default 0), vLLM in one process: the CPU-time "
                         "columns then count each engine's whole work, a fair ratio where other jobs share the machine")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed calls of each workload in each engine (prefix cache reset before each); the "
                         "fastest counts, every call's time is printed")
    ap.add_argument("--json", help="also write every figure (token ids included) to this file")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats: at least 1")

    from batchrun import cpuinfo
    from batchrun.engine import cpu_dtype
    flags = cpuinfo.cpu_flags()
    cpu = dict(model=cpuinfo.cpu_model(), cores=os.cpu_count(), flags=[f for f in FLAGS if f in flags],
               auto_dtype=cpu_dtype.auto_cpu_dtype()[1], load_average=os.getloadavg()[0])
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags'])}; auto dtype {cpu['auto_dtype']}; "
          f"load average {cpu['load_average']:.2f}")
    from transformers import AutoTokenizer
    models = {name: bench_models.model_path(name) for name in args.model.split(",")}
    # Every bench model shares SmolLM2's tokenizer, so one set of prompts serves them all.
    work = workloads(AutoTokenizer.from_pretrained(next(iter(models.values()))), args.data, args.limit,
                     args.workloads.split(","))
    for name, w in work.items():
        print(f"workload {name}: {len(w['prompts'])} prompts, {sum(map(len, w['prompts']))} prompt tokens, "
              f"{sum(w['max_tokens'])} output tokens")

    one_core = args.one_core is not None
    if one_core:
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {args.one_core})
    results = dict(cpu=cpu, models=models, runs={}, one_core=args.one_core)
    for model, path in models.items():
        for dtype in args.dtypes.split(","):
            run = results["runs"].setdefault(model, {})[dtype] = {}
            if not args.skip_vllm:
                run["vllm"] = run_vllm(path, dtype, work, args.max_num_seqs, args.vllm_default_threads,
                                       args.one_core, repeats=args.repeats)
            run["batchrun"] = run_batchrun(path, dtype, work, args.max_num_seqs, args.repeats)
            if dtype == "float32" and not args.skip_transformers:
                run["transformers"] = run_transformers(path, {"sample": work["sample"]} if "sample" in work
                                                       else work, args.hf_batch_size)
            print(f"{model} {dtype} done, load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    cpu["load_average_end"] = os.getloadavg()[0]
    print_table(results, list(work))
    first = next(iter(next(iter(results["runs"].values())).values()))
    if "vllm" in first:
        threads = (f"one, core {args.one_core}, both engines" if one_core
                   else "its default" if args.vllm_default_threads else "all cores for compute")
        print(f"vLLM {first['vllm']['version']}, threads: {threads}; "
              f"load average {cpu['load_average']:.2f} at start, {cpu['load_average_end']:.2f} at end")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
