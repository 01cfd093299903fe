"""Kill -9 at several moments, SIGTERM, a second submit: every input id ends up exactly once, none redone."""
import collections
import json
import os
import signal
import time

import pyarrow.dataset as ds
from click.testing import CliRunner

from batchrun import Job
from batchrun.cli import main
from batchrun.job.errors import EXIT_INTERRUPTED, EXIT_LOCKED, EXIT_OK
from batchrun.job.sink import ShardStore
from jobkit import cli, start_submit, write_job, write_prompts

SLOW = {"engine": {"max_num_seqs": 2}, "sampling": {"max_tokens": 12, "ignore_eos": True},
        "output": {"shard_rows": 3, "flush_every_s": 0.5}}


def committed(out: str) -> list[int]:
    table = ShardStore(out).read(["row_index"])
    return [] if table is None else table.column(0).to_pylist()


def shard_bytes(out: str) -> dict[str, bytes]:
    return {path: open(path, "rb").read() for _, _, path in ShardStore(out).shards()}


def wait_for(predicate, proc, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"submit ended early ({proc.returncode}): {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def assert_exactly_once(out: str, ids: list[str]) -> None:
    got = ds.dataset(os.path.join(out, "data")).to_table(columns=["id"]).column("id").to_pylist()
    counts = collections.Counter(got)
    assert not [i for i, n in counts.items() if n > 1], "duplicated ids"
    assert set(got) == set(ids), f"lost ids: {sorted(set(ids) - set(got))[:5]}"


def test_kill9_at_several_moments_then_resume_exactly_once(tmp_path, tiny_model):
    ids = write_prompts(tmp_path / "in.parquet", 48)
    job = write_job(tmp_path, tiny_model[0], **SLOW)
    out = str(tmp_path / "out" / "job")
    moments = [lambda: os.path.exists(os.path.join(out, ".lock")),   # starting: lock taken, nothing written
               lambda: len(committed(out)) >= 3,                       # just after the first shard
               lambda: len(committed(out)) >= 15]                      # later, with rows from an earlier run
    kept: dict[str, bytes] = {}
    for moment in moments:
        proc = start_submit(job)
        wait_for(moment, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        done = committed(out)
        assert len(done) == len(set(done)) < len(ids)
        assert all(shard_bytes(out).get(path) == data for path, data in kept.items()), "a saved shard changed"
        kept = shard_bytes(out)
    # a writer killed mid-shard leaves only a hidden temporary, which readers skip and resume deletes
    with open(os.path.join(out, "data", ".part-000999.parquet.tmp"), "wb") as f:
        f.write(b"half a shard")
    before = len(committed(out))
    # engine settings are not part of the job's identity: resume with a wider batch
    final = cli("submit", job, "--progress", "log", "--set", "engine.max_num_seqs=16")
    assert final.returncode == EXIT_OK, final.stderr
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["rows_this_run"] == len(ids) - before, "finished rows were generated again"
    assert all(shard_bytes(out)[path] == data for path, data in kept.items())
    assert not [f for f in os.listdir(os.path.join(out, "data")) if f.endswith(".tmp")]
    assert_exactly_once(out, ids)


def test_lock_and_sigterm(tmp_path, tiny_model):
    ids = write_prompts(tmp_path / "in.parquet", 120)
    job = write_job(tmp_path, tiny_model[0], **SLOW)
    out = str(tmp_path / "out" / "job")
    proc = start_submit(job)
    wait_for(lambda: len(committed(out)) >= 3, proc)
    assert Job.from_yaml(job).status()["state"] == "running"
    second = CliRunner().invoke(main, ["submit", job])
    assert second.exit_code == EXIT_LOCKED
    assert f"already running (pid {proc.pid})" in second.output
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    assert time.monotonic() - start < 10
    assert "stopped by SIGTERM" in stderr
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["status"] == "interrupted" and summary["rows_done"] == len(committed(out)) > 0
    assert summary["rows_remaining"] == len(ids) - summary["rows_done"] > 0
    assert Job.from_yaml(job).status()["state"] == "stopped"
    resumed = cli("submit", job, "--progress", "log", "--set", "engine.max_num_seqs=16")
    assert resumed.returncode == EXIT_OK, resumed.stderr
    assert_exactly_once(out, ids)


def test_signals_during_wind_down_keep_exit_code_5(tmp_path, tiny_model):
    """Ctrl-C, then Ctrl-C again and again while the job stops, writes its summary and the process winds down:
    the exit code stays 5 (never 130 from an uncaught KeyboardInterrupt) and the finished rows are saved."""
    write_prompts(tmp_path / "in.parquet", 60)
    job = write_job(tmp_path, tiny_model[0], **SLOW)
    out = str(tmp_path / "out" / "job")
    proc = start_submit(job)
    wait_for(lambda: len(committed(out)) >= 2, proc)
    proc.send_signal(signal.SIGINT)
    while proc.poll() is None:
        time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
    stderr = proc.stderr.read()
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr
    assert len(committed(out)) >= 2
