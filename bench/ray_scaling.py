"""The same job through executor local and through Ray with 1 and 2 replicas, one torch thread each, in one run.

    python bench/ray_scaling.py [--model smollm2-135m] [--rows 64] [--max-tokens 32] [--eager] [--json out.json]

Each run is `batchrun submit` in a subprocess on a fresh output directory; Ray runs start their own local Ray
(127.0.0.1). Figures from each run's summary.json:
  gen tok/s   output tokens / generation time: local, the engine loop's wall time; Ray, the sum over replicas of
              each one's tokens / (its last batch's end - its model loaded), so replica start-up is left out as the
              local figure leaves out the model load
  e2e tok/s   output tokens / the whole submit's wall time (start-up, model loads and Ray included)
  first row   seconds from the start of the pipeline (Ray) to the first committed batch
  peak RSS    per replica (Ray), of the replica's process
--eager runs every engine without torch.compile (BATCHRUN_COMPILE=0): on a busy 2-core machine the compile of the
first forward takes a minute or more per process and dominates a short run.
Goals (issue 13): Ray 1 replica >= 90 % of local gen tok/s; 2 replicas >= 1.7x one replica.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tmp: str, name: str, args, executor: dict) -> dict:
    spec = {"name": name, "model": args.model,
            "input": {"path": os.path.join(ROOT, "sample_data", "prompts.parquet"), "limit": args.rows,
                      "chat": True},
            "sampling": {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True},
            "engine": {"kv_cache_memory": "1GiB", "max_num_seqs": args.max_num_seqs},
            "output": {"path": os.path.join(tmp, name)}, "executor": executor}
    job = os.path.join(tmp, f"{name}.yaml")
    with open(job, "w") as f:
        yaml.safe_dump(spec, f)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"BATCHRUN_COMPILE": "0"} if args.eager else {})}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "batchrun.cli", "submit", job, "--progress", "log"],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    with open(os.path.join(tmp, name, "summary.json")) as f:
        s = json.load(f)
    tokens = s["output_tokens_this_run"]
    replicas = s.get("replicas", [])
    gen = sum(r["output_tokens_per_s"] for r in replicas) if replicas else s["output_tokens_per_s"]
    return {"run": name, "rows": s["rows_this_run"], "output_tokens": tokens, "gen_tok_s": round(gen, 2),
            "e2e_tok_s": round(tokens / wall, 2), "submit_wall_s": round(wall, 1),
            "first_row_s": s.get("time_to_first_row_s"),
            "replica_peak_rss_mib": [round(r["peak_rss_bytes"] / 2**20) for r in replicas],
            "replica_load_s": [round(r["load_s"], 1) for r in replicas]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--eager", action="store_true", help="no torch.compile in any engine")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    ray = {"kind": "ray", "cpus_per_replica": 1, "batch_size": 8, "max_batches_in_flight": 4}
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(tmp, "local", args, {"kind": "local"}),
                   run(tmp, "ray1", args, {**ray, "replicas": 1}),
                   run(tmp, "ray2", args, {**ray, "replicas": 2})]
    for r in results:
        print(json.dumps(r))
    local, one, two = (r["gen_tok_s"] for r in results)
    print(f"ray 1 replica / local: {one / local:.2f} (goal >= 0.90); 2 replicas / 1: {two / one:.2f} (goal >= 1.7)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
