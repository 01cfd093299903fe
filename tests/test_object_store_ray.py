"""executor: ray with s3:// input and output (SeaweedFS on 127.0.0.1, a Ray head and two worker nodes on loopback):
replicas read their row groups from the bucket and commit their shards to it directly, no shared filesystem; a
replica SIGKILLed mid-job leaves every id exactly once, equal to a local run."""
import collections
import io
import os
import signal
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun import Job
from batchrun.job.errors import EXIT_OK, JobError
from batchrun.job.object_shards import ObjectShardStore
from batchrun.job.storage import Storage
from jobkit import WORDS, write_job
from raykit import ENGINE_ENV, local_cluster
from s3kit import BUCKET, env_for

ROWS = 300
SECTIONS = {"sampling": {"max_tokens": 4, "temperature": 0}, "engine": {"max_num_seqs": 16}}
RAY = {"kind": "ray", "replicas": 2, "batch_size": 16, "max_batches_in_flight": 2}


@pytest.fixture(scope="module")
def s3_cluster(s3_server):
    """A head and two worker nodes whose processes (and so the replicas) have the server's credentials."""
    yield from local_cluster({**env_for(s3_server.endpoint), **ENGINE_ENV})


def prompts_table() -> pa.Table:
    ids = [f"r{i:05d}" for i in range(ROWS)]
    prompts = [" ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(2 + i % 17)) for i in range(ROWS)]
    return pa.table({"id": ids, "prompt": prompts})


def texts(table: pa.Table) -> dict:
    ids = table.column("id").to_pylist()
    assert not [i for i, n in collections.Counter(ids).items() if n > 1], "an id is in the output twice"
    return dict(zip(ids, table.column("text").to_pylist()))


def replica_pids() -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"MapBatches(ReplicaEngine)" in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_ray_reads_and_writes_s3_exactly_once_with_a_replica_killed(s3_server, s3_cluster, tmp_path, tiny_model,
                                                                      monkeypatch):
    for key, value in env_for(s3_server.endpoint).items():
        monkeypatch.setenv(key, value)
    for key, value in ENGINE_ENV.items():
        monkeypatch.setenv(key, value)
    uri = f"s3://{BUCKET}/ray"
    buffer = io.BytesIO()
    pq.write_table(prompts_table(), buffer, row_group_size=100)   # three row groups: three read tasks
    s3_server.put("ray/in.parquet", buffer.getvalue())
    pq.write_table(prompts_table(), tmp_path / "in.parquet")
    local = Job.from_yaml(write_job(tmp_path, tiny_model[0], name="local", **SECTIONS)).run(progress="log")
    job = write_job(tmp_path, tiny_model[0], name="ray", input_path=f"{uri}/in.parquet",
                    output={"path": f"{uri}/out"}, executor=RAY, **SECTIONS)
    out = Storage(f"{uri}/out")
    killed = []

    def kill_a_replica_after_the_first_commit():
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not ObjectShardStore(out).shards():
            time.sleep(0.1)
        pids = replica_pids()
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])
    watcher = threading.Thread(target=kill_a_replica_after_the_first_commit, daemon=True)
    watcher.start()
    result = Job.from_yaml(job).run(progress="log")
    watcher.join()
    assert killed, "no replica to kill"
    assert result.exit_code == EXIT_OK
    got = result.table()
    assert got.column("id").to_pylist() == prompts_table().column("id").to_pylist()
    assert texts(got) == texts(local.table())
    assert result.summary["rows_ok"] == ROWS and result.summary["executor"] == "ray"


class FakeRay:
    """Two live nodes on two hosts: a multi-host cluster."""

    @staticmethod
    def cluster_resources():
        return {"CPU": 8}

    @staticmethod
    def nodes():
        return [{"NodeManagerAddress": host, "Alive": True} for host in ("10.0.0.1", "10.0.0.2")]


def test_uris_need_no_shared_filesystem_on_a_multi_host_cluster(tmp_path, tiny_model):
    from batchrun.job.ray_executor import RayJobRunner
    on_s3 = RayJobRunner(Job.from_yaml(write_job(tmp_path, tiny_model[0], name="s3", input_path="s3://b/in.parquet",
                                                 output={"path": "s3://b/out"}, executor=RAY)).spec)
    on_s3.ray = FakeRay
    on_s3._check_cluster()   # no refusal
    local = RayJobRunner(Job.from_yaml(write_job(tmp_path, tiny_model[0], name="local", executor=RAY)).spec)
    local.ray = FakeRay
    with pytest.raises(JobError, match="spans 2 hosts .* not both URIs"):
        local._check_cluster()
