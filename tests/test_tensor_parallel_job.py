"""A `submit --tp 2` job whose rank 1 is killed (SIGKILL) mid-run stops with exit code 5 and its finished rows
saved; submitted again it resumes: every id exactly once, each row's text the TP 1 run's. A rank that hangs fails
the step at the collective timeout instead of blocking rank 0."""
import os
import signal
import threading

import pyarrow.dataset as ds
import pytest

from batchrun import LLM, SamplingParams
from batchrun.job.errors import EXIT_INTERRUPTED, EXIT_OK
from batchrun.engine.parallel import TensorParallelError
from jobkit import cli, start_submit, write_job, write_prompts
from test_job_resume import assert_exactly_once, committed, wait_for

SLOW = {"engine": {"max_num_seqs": 2}, "sampling": {"max_tokens": 12, "ignore_eos": True},
        "output": {"shard_rows": 3, "flush_every_s": 0.5}}


def worker_pids(pid: int) -> list[int]:
    """The tensor-parallel worker processes among `pid`'s children (spawned: their command runs spawn_main)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    return [c for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]


def texts(out: str) -> dict[str, str]:
    table = ds.dataset(os.path.join(out, "data")).to_table(columns=["id", "text"]).to_pylist()
    return {r["id"]: r["text"] for r in table}


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    monkeypatch.setenv("BATCHRUN_COMPILE", "0")   # the CLI subprocesses and their workers skip compiling


def test_rank_killed_then_resumed_exactly_once_equal_to_tp1(tmp_path, tiny_model):
    ids = write_prompts(tmp_path / "in.parquet", 15)
    reference = write_job(tmp_path, tiny_model[0], name="tp1", **SLOW)
    assert cli("submit", reference, "--progress", "log").returncode == EXIT_OK
    job = write_job(tmp_path, tiny_model[0], name="tp2", **SLOW)
    out = str(tmp_path / "out" / "tp2")
    proc = start_submit(job, "--tp", "2")
    wait_for(lambda: len(committed(out)) >= 3, proc)
    (rank1,) = worker_pids(proc.pid)
    os.kill(rank1, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, stderr[-2000:]
    assert f"rank 1 (pid {rank1}) died (signal SIGKILL)" in stderr
    done = committed(out)
    assert 3 <= len(done) == len(set(done)) < len(ids)
    resumed = cli("submit", job, "--progress", "log", "--tp", "2")
    assert resumed.returncode == EXIT_OK, resumed.stderr[-2000:]
    assert_exactly_once(out, ids)
    assert texts(out) == texts(str(tmp_path / "out" / "tp1"))


@pytest.mark.slow   # about 10 s quiet, 25 s on a loaded 2-core machine
def test_hung_rank_fails_the_step_at_the_timeout(tiny_model, monkeypatch):
    from batchrun.engine.parallel import group
    monkeypatch.setattr(group, "TIMEOUT_S", 3.0)
    llm = LLM(model=tiny_model[0], kv_cache_memory="1MiB", block_size=4, tensor_parallel_size=2)
    rank1 = llm.engine.runner.workers[0].process
    threading.Timer(0.5, os.kill, (rank1.pid, signal.SIGSTOP)).start()
    with pytest.raises(TensorParallelError, match="no rank exited; the step failed on rank 0 or in a collective"):
        llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=2000, ignore_eos=True), use_tqdm=False)
    assert not rank1.is_alive()
    with pytest.raises(TensorParallelError):   # the engine stays stopped
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()


def test_ray_replica_gpus_must_hold_the_ranks(tmp_path, tiny_model):
    from batchrun.job import Job, JobError
    job = write_job(tmp_path, tiny_model[0], executor={"kind": "ray", "gpus_per_replica": 1},
                    engine={"tensor_parallel_size": 2})
    with pytest.raises(JobError, match="executor.gpus_per_replica.*tensor_parallel_size"):
        Job.from_yaml(job)
