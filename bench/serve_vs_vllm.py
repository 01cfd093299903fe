"""`batchrun serve` against `vllm serve` (vLLM's CPU build), measured by vLLM's own benchmark client.

    python bench/serve_vs_vllm.py [--dtype float32] [--rates inf,1] [--num-prompts 64] [--json out.json]

Per server in turn (never both at once), on the embedded SmolLM2 directory: random prompts of --input-len tokens,
--output-len output tokens with EOS ignored, on /v1/completions and /v1/chat/completions, at each request rate.
Reports output tok/s, TTFT and TPOT (median and p99) as the client measures them, and the ratio batchrun / vLLM.
vLLM runs with every core for compute, as bench/vs_vllm.py gives it; its venv comes from bench/setup_vllm.sh.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from batchrun.cpuinfo import cpu_flags, cpu_model
from batchrun.engine.loader import resolve_model_path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("BATCHRUN_VLLM_VENV", Path.home() / ".cache" / "batchrun" / "vllm-venv"))
ENDPOINTS = {"completions": ("openai", "/v1/completions"), "chat": ("openai-chat", "/v1/chat/completions")}


def start(server: str, model: str, dtype: str, port: int, max_num_seqs: int, log) -> subprocess.Popen:
    if server == "batchrun":
        cmd = [sys.executable, "-m", "batchrun.cli", "serve", "--model", model, "--port", str(port),
               "--served-model-name", "model", "--max-num-seqs", str(max_num_seqs), "--engine", f"dtype={dtype}"]
        env = dict(os.environ)
    else:
        cmd = [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "model", "--port", str(port), "--dtype", dtype, "--max-num-seqs",
               str(max_num_seqs), "--host", "127.0.0.1"]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_TARGET_DEVICE": "cpu",
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server} exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{server} did not answer within 600 s; see {log.name}")


def client(port: int, model: str, endpoint: str, rate: str, args, out_dir: str) -> dict:
    backend, path = ENDPOINTS[endpoint]
    name = f"{endpoint}-{rate}.json"
    cmd = [str(VENV / "bin" / "python"), str(ROOT / "bench" / "vllm_bench_serve.py"), "--backend", backend,
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", path, "--model", "model", "--tokenizer", model,
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--num-prompts", str(args.num_prompts), "--ignore-eos", "--request-rate", rate,
           "--seed", "0", "--save-result", "--result-dir", out_dir, "--result-filename", name,
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
    subprocess.run(cmd, check=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    r = json.load(open(os.path.join(out_dir, name)))
    return {"completed": r["completed"], "output_tok_s": round(r["output_throughput"], 1),
            "ttft_ms_p50": round(r["median_ttft_ms"], 1), "ttft_ms_p99": round(r["p99_ttft_ms"], 1),
            "tpot_ms_p50": round(r["median_tpot_ms"], 1), "tpot_ms_p99": round(r["p99_tpot_ms"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rates", default="inf,1")
    ap.add_argument("--endpoints", default="completions,chat")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--servers", default="batchrun,vllm", help="which to run (the table needs both)")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = resolve_model_path("smollm2-135m")
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags())
    results = {"cpu": cpu_model(), "flags": flags, "dtype": args.dtype, "cells": {}}
    with tempfile.TemporaryDirectory() as out_dir:
        for port, server in ((8311, "batchrun"), (8312, "vllm")):
            if server not in args.servers.split(","):
                continue
            with open(os.path.join(out_dir, f"{server}.log"), "w") as log:
                proc = start(server, model, args.dtype, port, args.max_num_seqs, log)
                try:
                    client(port, model, "completions", "inf", argparse.Namespace(**{**vars(args), "num_prompts": 4}),
                           out_dir)   # warm-up: compilation and first allocations stay out of the figures
                    for endpoint in args.endpoints.split(","):
                        for rate in args.rates.split(","):
                            cell = client(port, model, endpoint, rate, args, out_dir)
                            results["cells"][f"{server}/{endpoint}/{rate}"] = cell
                            print(server, endpoint, f"rate {rate}", cell, flush=True)
                finally:
                    proc.terminate()
                    proc.wait(60)
    if len(args.servers.split(",")) < 2:
        return
    print(f"\n{results['cpu']} ({flags}), {args.dtype}, {args.num_prompts} prompts of {args.input_len} tokens, "
          f"{args.output_len} out, EOS ignored, load average at the end {os.getloadavg()[0]:.1f}")
    print(f"{'endpoint':12} {'rate':>5} {'batchrun tok/s':>15} {'vLLM tok/s':>11} {'ratio':>6} "
          f"{'TPOT p50 b/v ms':>17} {'TTFT p50 b/v ms':>17}")
    for endpoint in args.endpoints.split(","):
        for rate in args.rates.split(","):
            b, v = results["cells"][f"batchrun/{endpoint}/{rate}"], results["cells"][f"vllm/{endpoint}/{rate}"]
            print(f"{endpoint:12} {rate:>5} {b['output_tok_s']:>15} {v['output_tok_s']:>11} "
                  f"{b['output_tok_s'] / v['output_tok_s']:>5.2f}x {b['tpot_ms_p50']:>8}/{v['tpot_ms_p50']:<8} "
                  f"{b['ttft_ms_p50']:>8}/{v['ttft_ms_p50']:<8}")
    if args.json:
        json.dump(results, open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
