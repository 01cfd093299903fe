"""A job on a local path vs the same job on s3:// (a SeaweedFS server on 127.0.0.1): the runner's own time per row,
`batchrun status` on the finished output, resume after kill -9 at half, and `status` on an output of many shards.

    python bench/object_store.py [--rows 100000] [--files 4] [--status-shards 10000] [--workdir /tmp/object_store]

The tiny random model and input of bench/job_scale.py (max_tokens 1, prompts of 5-40 words, --files Parquet files),
shard_rows 4096. On s3:// the input is read from a prefix in the bucket and the output written there. Goals (issue
32): overhead and status <= 1.5x the local figures, resume after a kill at half < 15 s to the first new admission.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from job_scale import CHILD, make_input, make_model  # noqa: E402
from s3kit import BUCKET, S3Server, env_for  # noqa: E402


def write_job(workdir: str, model: str, name: str, input_path: str, output_path: str) -> str:
    job = {"name": name, "model": model, "input": {"path": input_path},
           "sampling": {"max_tokens": 1, "ignore_eos": True},
           "engine": {"kv_cache_memory": "256MiB", "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                      "device": "cpu"},
           "output": {"path": output_path, "shard_rows": 4096}, "batching": {"window": 8192}}
    path = os.path.join(workdir, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


def run(job: str) -> dict:
    """One submit in its own process: wall time, the runner's time per row outside LLM.step(), then status."""
    proc = subprocess.run([sys.executable, "-c", CHILD, job], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"submit of {job} failed: {proc.stderr[-2000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = report["rows"]
    start = time.perf_counter()
    status = subprocess.run([sys.executable, "-m", "batchrun.cli", "status", job], capture_output=True, text=True)
    status_cli_s = time.perf_counter() - start
    from batchrun import Job
    start = time.perf_counter()
    done = Job.from_yaml(job).status()["rows_done"]
    status_s = time.perf_counter() - start
    return dict(rows=rows, wall_s=round(report["wall_s"], 1), in_step_s=round(report["step_s"], 1),
                runner_overhead_ms_per_row=round((report["after_start_up_s"] - report["step_s"]) / rows * 1e3, 3),
                status_in_process_s=round(status_s, 3), status_cli_s=round(status_cli_s, 2),
                status_ok=status.returncode == 0 and done == rows)


def resume_after_kill(job: str, rows: int) -> dict:
    from batchrun import Job
    from batchrun.job.api import JobResult
    spec = Job.from_yaml(job).spec
    out = spec.output_storage()

    def done() -> int:
        try:
            return Job(spec).status().get("rows_done") or 0
        except Exception:   # noqa: BLE001 - job.json not written yet
            return 0
    proc = subprocess.Popen([sys.executable, "-m", "batchrun.cli", "submit", job, "--progress", "log"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while done() < rows // 2:
        time.sleep(0.5)
        if proc.poll() is not None:
            raise SystemExit("the job finished before it could be killed half way")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = done()
    start = time.perf_counter()
    resumed = subprocess.Popen([sys.executable, "-m", "batchrun.cli", "submit", job, "--progress", "log"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first_admission_s = None
    while resumed.poll() is None:   # the resumed run's first log line ("N rows, M already done") comes just
        log = out.read_text("job.log") or ""   # before its first admission
        if first_admission_s is None and log.count("already done") >= 2:
            first_admission_s = time.perf_counter() - start
        time.sleep(0.2)
    total = time.perf_counter() - start
    ids = JobResult(out.root, {"exit_code": resumed.returncode}, spec).table(input_order=False).column("id")
    return dict(rows_done_at_kill=before, resume_to_first_admission_s=round(first_admission_s or total, 2),
                resume_total_s=round(total, 2), exit_code=resumed.returncode, rows=len(ids),
                unique_ids=len(set(ids.to_pylist())))


def status_on_many_shards(uri: str, shards: int) -> dict:
    """An output of `shards` one-row shards with their manifest entries (written by 16 threads), then status."""
    import pyarrow as pa

    from batchrun.job.object_shards import ObjectShardStore, shard_name
    from batchrun.job.report import counts
    from batchrun.job.sink import result_schema
    from batchrun.job.storage import Storage
    out = Storage(uri)
    store = ObjectShardStore(out)
    schema = result_schema(pa.int64(), [])

    def commit(i: int) -> None:
        store.commit(shard_name(i, [i]), pa.Table.from_pylist(
            [{"id": i, "status": "ok", "row_index": i, "prompt_tokens": 3, "completion_tokens": 1}], schema=schema))
    start = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(commit, range(1, shards + 1)))
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    c = counts(out)
    return dict(shards=shards, write_s=round(write_s, 1), status_counts_s=round(time.perf_counter() - start, 3),
                rows_done=c["rows_done"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--status-shards", type=int, default=10_000)
    ap.add_argument("--workdir", default="/tmp/object_store")
    args = ap.parse_args()
    from batchrun.cpuinfo import cpu_model
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    server = S3Server(os.path.join(args.workdir, "seaweedfs"))
    server.start()
    try:
        os.environ.update(env_for(server.endpoint))   # the submits inherit it
        model = os.path.join(args.workdir, "tiny-model")
        make_model(model)
        local_in = os.path.join(args.workdir, "in")
        make_input(local_in, args.rows, args.files)
        for name in sorted(os.listdir(local_in)):
            server.put(f"in/{name}", open(os.path.join(local_in, name), "rb").read())
        print(f"CPU {cpu_model()}, {os.cpu_count()} cores, {args.rows} rows, SeaweedFS at {server.endpoint}")
        s3 = f"s3://{BUCKET}"
        jobs = {"local": write_job(args.workdir, model, "local", local_in, os.path.join(args.workdir, "out")),
                "s3": write_job(args.workdir, model, "s3", f"{s3}/in", f"{s3}/out")}
        results = {where: run(job) for where, job in jobs.items()}
        for where, r in results.items():
            print(json.dumps({where: r}), flush=True)
        print(json.dumps({"s3 / local": {k: round(results["s3"][k] / max(results["local"][k], 1e-9), 2)
                                         for k in ("runner_overhead_ms_per_row", "status_in_process_s",
                                                   "status_cli_s", "wall_s")}}), flush=True)
        resume = write_job(args.workdir, model, "s3-resume", f"{s3}/in", f"{s3}/resume")
        print(json.dumps({"s3 resume_after_kill_9": resume_after_kill(resume, args.rows)}), flush=True)
        if args.status_shards:
            print(json.dumps({"s3 status_on_many_shards": status_on_many_shards(f"{s3}/many", args.status_shards)}),
                  flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
