"""Helpers for the job tests: a small Parquet input, a job file over the tiny model, the CLI in a subprocess (and
`plan` in this process)."""
from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from click.testing import CliRunner

from batchrun.cli import main

WORDS = "the quick brown fox jumps over the lazy dog batch inference keeps the gpu busy".split()


def write_prompts(path, n: int = 30, **extra_columns) -> list[str]:
    ids = [f"row-{i:03d}" for i in range(n)]
    prompts = [" ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(2 + (i * 7) % 23)) for i in range(n)]
    pq.write_table(pa.table({"id": ids, "prompt": prompts, **extra_columns}), path)
    return ids


def write_job(tmp_path, model_dir: str, name: str = "job", input_path: str = "in.parquet", **sections) -> str:
    """A job file in tmp_path; keyword sections (input=..., sampling=...) update the defaults."""
    spec = {"name": name, "model": model_dir,
            "engine": {"kv_cache_memory": "4MiB", "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 64},
            "input": {"path": input_path}, "sampling": {"max_tokens": 6, "temperature": 0},
            "output": {"path": f"out/{name}", "shard_rows": 4}}
    for section, values in sections.items():
        spec[section] = {**spec.get(section, {}), **values} if isinstance(values, dict) else values
    path = os.path.join(tmp_path, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(spec, f)
    return path


def cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchrun.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def plan(*args) -> subprocess.CompletedProcess:
    """`batchrun plan ARGS` in this process, through click's test runner, returned as cli() returns it. The planner
    tests call it a dozen times, and a subprocess pays about 3 s of imports each time; cli() stays for what needs the
    process boundary (submit, signals, exit codes set by the interpreter)."""
    result = CliRunner().invoke(main, ["plan", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["batchrun", "plan", *args], result.exit_code, result.stdout, result.stderr)


def start_submit(job: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchrun.cli", "submit", job, "--progress", "log", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
