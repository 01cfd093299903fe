"""executor: ray on a local Ray cluster (loopback only: a head and two worker nodes, logical CPUs): the same output
as a local run, exactly once when a replica, the driver or a worker node dies, and bad input refused before work."""
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchrun import Job
from batchrun.cli import main
from batchrun.job.errors import EXIT_FAILED_ROWS, EXIT_INVALID, JobError
from batchrun.job.sink import ShardStore
from jobkit import WORDS, cli, write_job
from raykit import ENGINE_ENV, local_cluster

ROWS = 1000
BAD_ROW = 7   # a null prompt: fails alone, on either executor
RAY = {"kind": "ray", "replicas": 2, "batch_size": 32, "max_batches_in_flight": 2}
SECTIONS = {"sampling": {"max_tokens": 4, "temperature": 0}, "engine": {"max_num_seqs": 16}}


@pytest.fixture(scope="module")
def cluster():
    yield from local_cluster(ENGINE_ENV)


def write_input(path) -> list[str]:
    ids = [f"r{i:05d}" for i in range(ROWS)]
    prompts = [" ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(2 + i % 17)) for i in range(ROWS)]
    prompts[BAD_ROW] = None
    # several row groups: several read tasks
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), path, row_group_size=250)
    return ids


@pytest.fixture(scope="module")
def local_texts(tmp_path_factory, tiny_model):
    """id -> (status, text) of the job on the local executor."""
    tmp = tmp_path_factory.mktemp("local")
    write_input(tmp / "in.parquet")
    run = subprocess.run([sys.executable, "-m", "batchrun.cli", "submit", write_job(tmp, tiny_model[0], **SECTIONS),
                          "--progress", "log"], capture_output=True, text=True, env={**os.environ, **ENGINE_ENV})
    assert run.returncode == EXIT_FAILED_ROWS, run.stderr[-2000:]
    return texts(str(tmp / "out" / "job"))


def texts(out: str) -> dict:
    table = ShardStore(out).read(["id", "status", "text"])
    ids = table.column("id").to_pylist()
    assert not [i for i, n in collections.Counter(ids).items() if n > 1], "an id is in the output twice"
    return dict(zip(ids, zip(table.column("status").to_pylist(), table.column("text").to_pylist())))


def ray_job(tmp_path, tiny_model, **executor) -> str:
    write_input(tmp_path / "in.parquet")
    return write_job(tmp_path, tiny_model[0], executor={**RAY, **executor}, **SECTIONS)


def replica_pids() -> list[int]:
    """Processes of the engine replicas (Ray names its workers' processes after the actor class)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"MapBatches(ReplicaEngine)" in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def after_first_commit(out: str, action) -> threading.Thread:
    """Run action once the first shard of the job is committed (in a thread, while the job runs)."""
    def watch():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not ShardStore(out).shards():
            time.sleep(0.05)
        action()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_two_replicas_match_local(cluster, tmp_path, tiny_model, local_texts):
    result = Job.from_yaml(ray_job(tmp_path, tiny_model)).run(progress="log")
    assert result.exit_code == EXIT_FAILED_ROWS   # the bad row, alone
    got = texts(result.output_dir)
    assert got == local_texts
    assert got[f"r{BAD_ROW:05d}"][0] == "error" and len(got) == ROWS
    summary = json.load(open(os.path.join(result.output_dir, "summary.json")))
    assert summary["rows_ok"] == ROWS - 1 and summary["executor"] == "ray"
    assert len(summary["replicas"]) == 2 and sum(r["rows"] for r in summary["replicas"]) == ROWS
    assert all(r["output_tokens_per_s"] > 0 and r["kv_pool_bytes"] > 0 for r in summary["replicas"])
    assert "batchrun_job_rows" in open(os.path.join(result.output_dir, "metrics.prom")).read()
    assert "ray: 2 replicas" in open(os.path.join(result.output_dir, "job.log")).read()


@pytest.mark.slow   # a Ray replica that starts a worker rank: about a minute here
def test_replica_runs_tensor_parallel_ranks(cluster, tmp_path, tiny_model, local_texts):
    """One replica whose engine splits the model over 2 ranks (2 CPU processes, gloo): the local run's output."""
    write_input(tmp_path / "in.parquet")
    job = write_job(tmp_path, tiny_model[0], executor={**RAY, "replicas": 1}, **SECTIONS | {
        "engine": {**SECTIONS["engine"], "tensor_parallel_size": 2}})
    result = Job.from_yaml(job).run(progress="log")
    assert result.exit_code == EXIT_FAILED_ROWS and texts(result.output_dir) == local_texts


def test_replica_killed_after_first_commit(cluster, tmp_path, tiny_model, local_texts):
    job = ray_job(tmp_path, tiny_model)
    out = str(tmp_path / "out" / "job")
    killed = []

    def kill_one():
        pids = replica_pids()
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])
    watcher = after_first_commit(out, kill_one)
    result = Job(Job.from_yaml(job).spec).run(progress="log")
    watcher.join()
    assert killed, "no replica to kill"
    assert result.exit_code == EXIT_FAILED_ROWS
    assert texts(out) == local_texts


def test_driver_killed_then_resubmitted(cluster, tmp_path, tiny_model, local_texts):
    job = ray_job(tmp_path, tiny_model)
    out = str(tmp_path / "out" / "job")
    address = cluster[0].address
    # a session of its own: whatever the driver starts goes with it
    driver = subprocess.Popen([sys.executable, "-m", "batchrun.cli", "submit", job, "--progress", "log",
                               "--address", address], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    deadline = time.monotonic() + 120
    while not ShardStore(out).shards():
        assert driver.poll() is None and time.monotonic() < deadline, "the driver ended before its first commit"
        time.sleep(0.05)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    kept = {path: open(path, "rb").read() for _, _, path in ShardStore(out).shards()}
    result = Job.from_yaml(job).run(progress="log")   # submitted again (here, on the test's own connection)
    assert result.exit_code == EXIT_FAILED_ROWS
    # the first run's shards (number 1: those seen at the kill, and any its replicas committed before the cluster
    # ended them) stay as they were; the second run (number 2) adds exactly the rows they lack
    shards = ShardStore(out).shards()
    first = sum(pq.read_metadata(path).num_rows for _, number, path in shards if number == 1)
    assert {number for _, number, _ in shards} == {1, 2} and 0 < first < ROWS
    assert result.summary["rows_this_run"] == ROWS - first, "finished rows ran again"
    assert all(open(path, "rb").read() == data for path, data in kept.items()), "a committed shard changed"
    assert texts(out) == local_texts


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def hosts_replica(node) -> bool:
    """Whether one of the replicas runs on this node (a replica's process descends from the node's raylet)."""
    raylet = node.all_processes["raylet"][0].process.pid
    for pid in replica_pids():
        with contextlib.suppress(OSError):
            while pid > 1 and pid != raylet:
                pid = parent(pid)
            if pid == raylet:
                return True
    return False


def test_worker_node_removed_mid_job(cluster, tmp_path, tiny_model, local_texts):
    c, workers = cluster
    out = str(tmp_path / "out" / "job")
    job = ray_job(tmp_path, tiny_model)
    removed = []

    def remove_a_replicas_node():
        node = next((n for n in workers if hosts_replica(n)), None)
        if node is not None:
            workers.remove(node)
            c.remove_node(node, allow_graceful=False)
            removed.append(node)
    watcher = after_first_commit(out, remove_a_replicas_node)
    result = Job.from_yaml(job).run(progress="log")
    watcher.join()
    assert removed, "no worker node held a replica"
    assert result.exit_code == EXIT_FAILED_ROWS
    assert texts(out) == local_texts


def test_missing_ray_names_the_extra(tmp_path, tiny_model, monkeypatch):
    job = ray_job(tmp_path, tiny_model)
    monkeypatch.setitem(sys.modules, "ray", None)   # as if not installed
    with pytest.raises(JobError, match=r"pip install 'batchrun\[ray\]'") as exc:
        Job.from_yaml(job).run(progress="log")
    assert exc.value.exit_code == EXIT_INVALID
    assert not os.path.exists(tmp_path / "out" / "job" / "data"), "work started"


@pytest.mark.parametrize("executor, field, message", [
    ({"kind": "slurm"}, "executor.kind", "unknown value 'slurm'; allowed: local, ray"),
    ({"kind": "ray", "replicas": 0}, "executor.replicas", "must be a positive integer or [min, max]"),
    ({"kind": "ray", "replicas": [4, 2]}, "executor.replicas", "must be a positive integer or [min, max]"),
])
def test_bad_executor_section(tmp_path, tiny_model, executor, field, message):
    job = write_job(tmp_path, tiny_model[0], executor=executor)
    run = CliRunner().invoke(main, ["submit", job])
    assert run.exit_code == EXIT_INVALID and f"{field} (line" in run.output and message in run.output


def test_executor_flags_and_python_override(tmp_path, tiny_model):
    job = write_job(tmp_path, tiny_model[0])
    run = CliRunner().invoke(main, ["submit", job, "--executor", "ray", "--replicas", "0"])
    assert run.exit_code == EXIT_INVALID and "executor.replicas" in run.output
    with pytest.raises(JobError, match="unknown executor 'dask'"):
        Job.from_yaml(job).run(executor="dask")


def test_more_replicas_than_the_cluster_holds(cluster, tmp_path, tiny_model):
    job = ray_job(tmp_path, tiny_model, replicas=[1, 8])
    with pytest.raises(JobError, match="8 replicas need 8 CPU in all, the cluster has") as exc:
        Job.from_yaml(job).run(progress="log")
    assert exc.value.exit_code == EXIT_INVALID


def test_plan_recommendation_carries_an_executor_stanza(tmp_path, tiny_model):
    from batchrun.job.spec import JobSpec
    from batchrun.planner.plan import recommend
    row = {"fits": True, "meets_deadline": True, "cost_usd": 12.0, "gpus": 6, "makespan_s": 5000.0,
           "gpu": "H100-80GB", "weights": "fp16", "kv_dtype": "int8", "usd_per_million_output_tokens": 0.5}
    stanza = recommend([row], 6 * 3600)["executor"]
    assert stanza == {"kind": "ray", "address": "auto", "replicas": 6, "gpus_per_replica": 1,
                      "accelerator_type": "H100"}
    spec = JobSpec({"model": tiny_model[0], "input": {"path": "in.parquet"}, "output": {"path": "out"},
                    "executor": stanza})   # a valid executor section as it stands
    assert spec.executor.replica_range == (6, 6) and spec.executor.accelerator_type == "H100"


def test_unreachable_address_refused_before_work(tmp_path, tiny_model):
    job = ray_job(tmp_path, tiny_model, address="127.0.0.1:1")
    run = cli("submit", job, "--progress", "log", timeout=60)
    assert run.returncode == EXIT_INVALID and "executor.address" in run.stderr and "nothing answers" in run.stderr
    assert not os.path.exists(tmp_path / "out" / "job" / "data"), "work started"


def test_n_samples_on_ray(cluster, tmp_path, tiny_model):
    """sampling.n on Ray: one row per (id, sample_index), the same rows as the local executor."""
    pq.write_table(pa.table({"id": [f"s{i}" for i in range(40)],
                             "prompt": [" ".join(WORDS[:2 + i % 9]) for i in range(40)]}), tmp_path / "in.parquet")
    sections = {"sampling": {"max_tokens": 3, "temperature": 1.0, "seed": 5, "n": 2, "ignore_eos": True},
                "engine": {"max_num_seqs": 16}}
    job = write_job(tmp_path, tiny_model[0], executor={**RAY, "batch_size": 8}, **sections)
    result = Job.from_yaml(job).run(progress="log")
    assert result.exit_code == 0
    table = ShardStore(result.output_dir).read(["id", "sample_index", "text"])
    rows = sorted(zip(*(table.column(c).to_pylist() for c in ("id", "sample_index", "text"))))
    assert [(i, k) for i, k, _ in rows] == sorted((f"s{i}", k) for i in range(40) for k in range(2))
    summary = json.load(open(os.path.join(result.output_dir, "summary.json")))
    assert summary["rows_ok"] == 40 and sum(r["rows"] for r in summary["replicas"]) == 40
