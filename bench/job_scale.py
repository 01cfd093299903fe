"""The job runner at scale: peak RSS of a submit, the runner's own time per row outside the engine's step, status
on the output, and resume after kill -9 at half way.

    python bench/job_scale.py [--rows 10000 100000 1000000] [--files 4] [--workdir /tmp/job_scale]

A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer, max_tokens 1, prompts of 5-40 words, the
input split over --files Parquet files. Each submit runs in its own process (peak RSS from wait4); the runner's
overhead is the job's wall time after start-up (model load) minus the time inside LLM.step(), per row. Goals (issue 14): RSS grows < 200 MiB
from 10k to 1M rows, overhead <= 0.5 ms/row, status < 2 s, resume skips the done rows in < 10 s.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

WORDS = "the quick brown fox jumps over the lazy dog while batch inference keeps every gpu busy all night".split()

CHILD = r"""
import json, sys, time
import batchrun.engine.llm as llm_module
from batchrun import Job
inside, ready = [0.0], [None]
real_init, real_step = llm_module.LLM.__init__, llm_module.LLM.step
def timed_init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    ready[0] = time.perf_counter()   # start-up (model load, compile) ends: the runner's per-row work is after
llm_module.LLM.__init__ = timed_init
def timed_step(self):
    start = time.perf_counter()
    try:
        return real_step(self)
    finally:
        inside[0] += time.perf_counter() - start
llm_module.LLM.step = timed_step
start = time.perf_counter()
result = Job.from_yaml(sys.argv[1]).run(progress="log")
end = time.perf_counter()
print(json.dumps(dict(wall_s=end - start, after_start_up_s=end - ready[0], step_s=inside[0],
                      rows=result.summary["rows_this_run"], exit_code=result.exit_code)))
"""


def make_model(path: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from batchrun.engine.loader import resolve_model_path
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def make_input(directory: str, rows: int, files: int) -> None:
    os.makedirs(directory, exist_ok=True)
    per_file = -(-rows // files)
    for f in range(files):
        start, stop = f * per_file, min(rows, (f + 1) * per_file)
        prompts = [" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(5 + i % 36)) for i in range(start, stop)]
        pq.write_table(pa.table({"id": pa.array(range(start, stop), pa.int64()), "prompt": prompts}),
                       os.path.join(directory, f"part-{f:03d}.parquet"))


def write_job(workdir: str, model: str, rows: int) -> str:
    job = {"name": f"scale-{rows}", "model": model, "input": {"path": f"in-{rows}"},
           "sampling": {"max_tokens": 1, "ignore_eos": True},
           "engine": {"kv_cache_memory": "256MiB", "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                      "device": "cpu"},
           "output": {"path": f"out-{rows}", "shard_rows": 4096}, "batching": {"window": 8192}}
    path = os.path.join(workdir, f"job-{rows}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


def run_child(job: str) -> tuple[dict, int]:
    """(the child's report, its peak RSS in bytes)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, job], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"submit of {job} failed (status {status})")
    return json.loads(out.strip().splitlines()[-1]), usage.ru_maxrss * 1024


def done_rows(out_dir: str) -> int:
    data = os.path.join(out_dir, "data")
    if not os.path.isdir(data):
        return 0
    total = 0
    for name in os.listdir(data):
        if name.endswith(".parquet") and not name.startswith("."):
            try:
                total += pq.ParquetFile(os.path.join(data, name)).metadata.num_rows
            except Exception:   # noqa: BLE001 - a file renamed away while we look
                pass
    return total


def resume_after_kill(workdir: str, job: str, rows: int) -> dict:
    out_dir = os.path.join(workdir, f"out-{rows}")
    shutil.rmtree(out_dir, ignore_errors=True)
    proc = subprocess.Popen([sys.executable, "-m", "batchrun.cli", "submit", job, "--progress", "log"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while done_rows(out_dir) < rows // 2:
        time.sleep(0.5)
        if proc.poll() is not None:
            raise SystemExit("the job finished before it could be killed half way")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = done_rows(out_dir)
    start = time.perf_counter()
    resumed = subprocess.Popen([sys.executable, "-m", "batchrun.cli", "submit", job, "--progress", "log"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = os.path.join(out_dir, "job.log")
    skipped_s = None
    while resumed.poll() is None:
        if skipped_s is None and os.path.exists(log) and open(log).read().count("already done") >= 2:
            skipped_s = time.perf_counter() - start
        time.sleep(0.1)
    total = time.perf_counter() - start
    table = pq.read_table(os.path.join(out_dir, "data"), columns=["id"])
    return dict(rows_done_at_kill=before, resume_to_first_admission_s=round(skipped_s or total, 2),
                resume_total_s=round(total, 2), exit_code=resumed.returncode, rows=table.num_rows,
                unique_ids=len(set(table.column("id").to_pylist())))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/job_scale")
    ap.add_argument("--skip-resume", action="store_true")
    args = ap.parse_args()
    from batchrun.cpuinfo import cpu_model
    os.makedirs(args.workdir, exist_ok=True)
    model = os.path.join(args.workdir, "tiny-model")
    if not os.path.isdir(model):
        make_model(model)
    print(f"CPU {cpu_model()}, {os.cpu_count()} cores")
    results = []
    for rows in args.rows:
        make_input(os.path.join(args.workdir, f"in-{rows}"), rows, args.files)
        job = write_job(args.workdir, model, rows)
        shutil.rmtree(os.path.join(args.workdir, f"out-{rows}"), ignore_errors=True)
        report, rss = run_child(job)
        overhead_ms = (report["after_start_up_s"] - report["step_s"]) / rows * 1e3
        start = time.perf_counter()
        status = subprocess.run([sys.executable, "-m", "batchrun.cli", "status", job], capture_output=True)
        status_cli_s = time.perf_counter() - start
        from batchrun import Job
        start = time.perf_counter()
        Job.from_yaml(job).status()
        status_s = time.perf_counter() - start
        r = dict(rows=rows, peak_rss_mib=round(rss / 2**20, 1), wall_s=round(report["wall_s"], 1),
                 in_step_s=round(report["step_s"], 1), runner_overhead_ms_per_row=round(overhead_ms, 3),
                 status_in_process_s=round(status_s, 2), status_cli_s=round(status_cli_s, 2),
                 status_ok=status.returncode == 0)
        results.append(r)
        print(json.dumps(r), flush=True)
    if len(results) > 1:
        print(f"RSS growth {results[0]['rows']} -> {results[-1]['rows']} rows: "
              f"{results[-1]['peak_rss_mib'] - results[0]['peak_rss_mib']:.1f} MiB")
    if not args.skip_resume:
        rows = args.rows[-1]
        print(json.dumps(dict(resume_after_kill_9=resume_after_kill(args.workdir, os.path.join(
            args.workdir, f"job-{rows}.yaml"), rows))), flush=True)


if __name__ == "__main__":
    main()
