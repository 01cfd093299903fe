"""Jobs on an object store, against a real S3-compatible server (SeaweedFS on 127.0.0.1, tests/s3kit.py): Parquet and
OpenAI batch in and out on s3://, the same rows as a local run; kill -9 at many moments then resume, exactly once;
the lock (a second submit exits 4, an expired or dead holder's lock is taken over, a holder whose lock is taken
stops); refusals before any work; no credential in any file written; `status` from one listing."""
import collections
import io
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun import Job
from batchrun.job.errors import EXIT_INTERRUPTED, EXIT_INVALID, EXIT_LOCKED, EXIT_OK
from batchrun.job.object_shards import ENTRIES, ObjectShardStore
from batchrun.job.storage import Storage
from jobkit import write_job, write_prompts
from s3kit import BUCKET, READER, WRITER, env_for

SLOW = {"engine": {"max_num_seqs": 2}, "sampling": {"max_tokens": 12, "ignore_eos": True},
        "output": {"shard_rows": 3, "flush_every_s": 0.5}}


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """The server, this process's environment pointed at it (writer credentials), and a prefix of the test's own."""
    for key, value in env_for(s3_server.endpoint).items():
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if k.startswith("AWS_") and k not in env_for(s3_server.endpoint)]:
        monkeypatch.delenv(key)
    s3_server.prefix = request.node.name.replace("[", "-").replace("]", "")
    s3_server.uri = f"s3://{BUCKET}/{s3_server.prefix}"
    return s3_server


def upload(s3, key: str, path) -> None:
    s3.put(f"{s3.prefix}/{key}", open(path, "rb").read())


def submit(job: str, env: dict, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchrun.cli", "submit", job, "--progress", "log", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def start(job: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchrun.cli", "submit", job, "--progress", "log"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def committed(out: Storage) -> list[int]:
    table = ObjectShardStore(out).read(["row_index"])
    return [] if table is None else table.column(0).to_pylist()


def rows_by_id(table: pa.Table) -> dict:
    ids = table.column("id").to_pylist()
    assert not [i for i, n in collections.Counter(ids).items() if n > 1], "an id is in the output twice"
    return dict(zip(ids, zip(table.column("status").to_pylist(), table.column("text").to_pylist())))


def wait_for(predicate, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"submit ended early ({proc.returncode}): {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_parquet_prefix_in_and_out_on_s3_equal_to_a_local_run(s3, tmp_path, tiny_model):
    ids = write_prompts(tmp_path / "in.parquet", 20)
    table = pq.read_table(tmp_path / "in.parquet")
    for k, part in enumerate((table.slice(0, 12), table.slice(12))):   # a prefix of two files
        buffer = io.BytesIO()
        pq.write_table(part, buffer)
        s3.put(f"{s3.prefix}/in/part-{k}.parquet", buffer.getvalue())
    (tmp_path / "schema.json").write_text(json.dumps({"type": "object"}))
    upload(s3, "schema.json", tmp_path / "schema.json")
    local = Job.from_yaml(write_job(tmp_path, tiny_model[0], name="local")).run(progress="log")
    job = write_job(tmp_path, tiny_model[0], name="s3", input_path=f"{s3.uri}/in",
                    output={"path": f"{s3.uri}/out", "order": "input"})
    result = Job.from_yaml(job).run(progress="log")
    assert result.exit_code == EXIT_OK and result.output_dir == f"{s3.uri}/out"
    got = result.table()
    assert got.column("id").to_pylist() == ids
    assert rows_by_id(got) == rows_by_id(local.table())
    keys = s3.keys(f"{s3.prefix}/out/")
    assert [k.rsplit("/", 1)[1] for k in keys if "/data/" in k and ENTRIES not in k] == ["sorted-000001.parquet"]
    assert {f"{s3.prefix}/out/{name}" for name in ("job.json", "summary.json", "metrics.prom", "job.log")} <= set(keys)
    assert f"{s3.prefix}/out/.lock" not in keys, "the lock was not released"
    summary = json.loads(s3.get(f"{s3.prefix}/out/summary.json"))
    assert summary["rows_ok"] == 20 and summary["rows_remaining"] == 0
    status = Job.from_yaml(job).status()
    assert status["state"] == "done" and status["rows_done"] == 20 and status["output"] == f"{s3.uri}/out"
    report = Job.from_yaml(job).validate()
    assert report["output"] == f"{s3.uri}/out" and report["output_state"].startswith("resume: 20 rows done")
    # a glob input and a schema file on s3 give the same rows
    glob_job = write_job(tmp_path, tiny_model[0], name="glob", input_path=f"{s3.uri}/in/part-*.parquet",
                         output={"path": f"{s3.uri}/glob"}, sampling={"json_schema_file": f"{s3.uri}/schema.json"})
    assert Job.from_yaml(glob_job).spec.sampling.json_schema == {"type": "object"}


def test_status_lists_once_and_reads_no_shard(s3, tmp_path, tiny_model, monkeypatch):
    write_prompts(tmp_path / "in.parquet", 12)
    job = write_job(tmp_path, tiny_model[0], output={"path": f"{s3.uri}/out", "shard_rows": 1})
    assert Job.from_yaml(job).run(progress="log").exit_code == EXIT_OK
    listings, opened = [], []
    real_list = Storage.list
    monkeypatch.setattr(Storage, "list", lambda self, prefix="": listings.append(prefix) or real_list(self, prefix))
    monkeypatch.setattr(Storage, "open_input", lambda self, name: opened.append(name))
    monkeypatch.setattr(ObjectShardStore, "_dataset", lambda *a, **k: opened.append("dataset"))
    status = Job.from_yaml(job).status()
    assert status["rows_done"] == 12 and status["rows_ok"] == 12 and status["completion_tokens"] == 12 * 6
    assert listings == ["data"] and not opened


@pytest.mark.parametrize("moments", [4, pytest.param(10, marks=pytest.mark.slow)])
def test_kill9_at_many_moments_then_resume_exactly_once(s3, tmp_path, tiny_model, moments):
    """Killed at the start (lock taken, nothing written) and after 3, 6, 9... committed rows (4 moments in the default
    suite, about 80 s here; the 10 of the issue with -m slow, about 200 s), then resumed: each id once, equal to a local
    run, no committed shard changed."""
    ids = write_prompts(tmp_path / "in.parquet", 48)
    env = env_for(s3.endpoint)
    reference = Job.from_yaml(write_job(tmp_path, tiny_model[0], name="local", **SLOW)).run(progress="log").table()
    job = write_job(tmp_path, tiny_model[0], name="s3", output={**SLOW["output"], "path": f"{s3.uri}/out"},
                    **{k: v for k, v in SLOW.items() if k != "output"})
    out = Storage(f"{s3.uri}/out")
    lock = f"{s3.prefix}/out/.lock"
    # starting (the lock object is there, nothing written), then after every few committed rows
    counts = (3, 6, 9, 12, 15, 18, 21, 24, 27) if moments == 10 else (3, 12, 24)
    kills = [lambda: lock in s3.keys(f"{s3.prefix}/out/")] + [lambda n=n: len(committed(out)) >= n for n in counts]
    kept: dict[str, bytes] = {}
    for moment in kills:
        proc = start(job, env)
        wait_for(moment, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        done = committed(out)
        assert len(done) == len(set(done)) < len(ids)
        shards = {k: s3.get(k) for k in s3.keys(f"{s3.prefix}/out/data/") if ENTRIES not in k}
        assert all(shards.get(k) == data for k, data in kept.items()), "a committed shard changed"
        kept = {k: data for k, data in shards.items() if k.rsplit("/", 1)[1] in
                {name for _, _, name in ObjectShardStore(out).shards()}}
    # a writer killed between its shard's PUT and its manifest entry: the shard is not trusted, and is deleted
    s3.put(f"{s3.prefix}/out/data/part-000999-0123456789abcdef.parquet", next(iter(kept.values())))
    before = len(committed(out))
    final = submit(job, env, "--set", "engine.max_num_seqs=16")   # the lock of the killed run: taken over at once
    assert final.returncode == EXIT_OK, final.stderr[-3000:]
    summary = json.loads(s3.get(f"{s3.prefix}/out/summary.json"))
    assert summary["rows_this_run"] == len(ids) - before, "finished rows were generated again"
    assert f"{s3.prefix}/out/data/part-000999-0123456789abcdef.parquet" not in s3.keys(f"{s3.prefix}/out/")
    assert all(s3.get(k) == data for k, data in kept.items())
    result = Job.from_yaml(job).run(progress="log")   # nothing left: reads the output back
    assert result.table().column("id").to_pylist() == ids
    assert rows_by_id(result.table()) == rows_by_id(reference)


def test_two_submits_at_once_the_second_exits_4_and_a_taken_lock_stops_the_holder(s3, tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", 120)
    env = env_for(s3.endpoint)
    job = write_job(tmp_path, tiny_model[0], output={**SLOW["output"], "path": f"{s3.uri}/out"},
                    storage={"lock_lease_s": 3}, **{k: v for k, v in SLOW.items() if k != "output"})
    out = Storage(f"{s3.uri}/out")
    proc = start(job, env)
    wait_for(lambda: len(committed(out)) >= 3, proc)
    assert Job.from_yaml(job).status()["state"] == "running"
    second = submit(job, env)
    assert second.returncode == EXIT_LOCKED, second.stderr[-2000:]
    assert f"{s3.uri}/out/.lock: the job is already running (pid {proc.pid} on" in second.stderr
    # another writer replaces the lock object: the holder's next renewal (If-Match) is refused, and it stops
    s3.put(f"{s3.prefix}/out/.lock", json.dumps({"host": "elsewhere", "pid": 1, "lease_s": 600}).encode())
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, stderr[-2000:]
    assert "another submit took over the lock" in stderr
    assert json.loads(s3.get(f"{s3.prefix}/out/.lock"))["host"] == "elsewhere", "the stopped holder deleted it"


def test_an_expired_lock_is_taken_over(s3, tmp_path, tiny_model):
    ids = write_prompts(tmp_path / "in.parquet", 6)
    job = write_job(tmp_path, tiny_model[0], output={"path": f"{s3.uri}/out"})
    s3.put(f"{s3.prefix}/out/.lock", json.dumps({"host": "crashed-host", "pid": 4242, "lease_s": 3}).encode())
    locked = submit(job, env_for(s3.endpoint))
    assert locked.returncode == EXIT_LOCKED and "pid 4242 on crashed-host" in locked.stderr
    time.sleep(4.5)   # the lease runs out by the server's clock (whole seconds)
    result = Job.from_yaml(job).run(progress="log")
    assert result.exit_code == EXIT_OK and sorted(result.table().column("id").to_pylist()) == ids
    log = s3.get(f"{s3.prefix}/out/job.log").decode()
    assert "took over the lock of pid 4242 on crashed-host" in log and "its lease ran out" in log
    assert f"{s3.prefix}/out/.lock" not in s3.keys(f"{s3.prefix}/out/")


@pytest.mark.parametrize("case", ["unknown scheme", "unknown input scheme", "missing credentials", "wrong secret",
                                  "bucket not found", "read-only credentials", "credentials in the URI",
                                  "secret in storage options", "unknown storage option", "missing input object"])
def test_refused_before_any_work_naming_the_path(s3, tmp_path, tiny_model, case):
    write_prompts(tmp_path / "in.parquet", 4)
    out, env, sections = f"{s3.uri}/out", env_for(s3.endpoint), {}
    field, expect = "output.path", None
    if case == "unknown scheme":
        out, expect = "nosuch://bucket/out", "nosuch://bucket/out: unknown scheme nosuch://"
    elif case == "unknown input scheme":
        sections["input_path"], field, expect = "nosuch://bucket/in.parquet", "input.path", "unknown scheme nosuch://"
    elif case == "missing credentials":
        env, expect = env_for(s3.endpoint, None), f"{out}: no AWS credentials found"
    elif case == "wrong secret":
        env, expect = env_for(s3.endpoint, (WRITER[0], "not-the-secret")), f"cannot write to {out}"
    elif case == "bucket not found":
        out, expect = "s3://no-such-bucket/out", "the bucket 'no-such-bucket' does not exist"
    elif case == "read-only credentials":
        env, expect = env_for(s3.endpoint, READER), f"cannot write to {out}"
    elif case == "credentials in the URI":
        out, expect = f"s3://AKIN:uri-secret@{BUCKET}/out", "credentials in a URI are not accepted"
    elif case == "secret in storage options":
        sections["storage"], field = {"options": {"secret_key": "options-secret"}}, "storage.options.secret_key"
        expect = "credentials are not accepted in the job file"
    elif case == "unknown storage option":
        sections["storage"], expect = {"options": {"regoin": "eu-west-1"}}, "storage.options: "
    elif case == "missing input object":
        sections["input_path"], field, expect = f"{s3.uri}/nothing-here.parquet", "input.path", "no input file at"
    run = submit(write_job(tmp_path, tiny_model[0], output={"path": out}, **sections), env)
    assert run.returncode == EXIT_INVALID, run.stderr[-2000:]
    assert field in run.stderr and expect in run.stderr, run.stderr[-2000:]
    assert "uri-secret" not in run.stderr and "options-secret" not in run.stderr
    assert "Traceback" not in run.stderr
    assert s3.keys(f"{s3.prefix}/") == [], "work started"


def test_no_credential_in_any_file_written(s3, tmp_path, tiny_model):
    """OpenAI batch in and out on s3://, with the secret in the environment: it is in no object or file the job
    writes, nor in its output."""
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"the quick fox {i}", "max_tokens": 3, "n": 1 + i % 2}})
             for i in range(6)]
    s3.put(f"{s3.prefix}/req.jsonl", ("\n".join(lines) + "\n").encode())
    job = write_job(tmp_path, tiny_model[0], input_path=f"{s3.uri}/req.jsonl",
                    output={"path": f"{s3.uri}/out", "openai_batch": True})
    run = submit(job, env_for(s3.endpoint))
    assert run.returncode == EXIT_OK, run.stderr[-2000:]
    out_lines = [json.loads(x) for x in s3.get(f"{s3.prefix}/out/output.jsonl").decode().splitlines()]
    assert [x["custom_id"] for x in out_lines] == [f"c{i}" for i in range(6)]
    assert [len(x["response"]["body"]["choices"]) for x in out_lines] == [1, 2] * 3
    written = {k: s3.get(k) for k in s3.keys(f"{s3.prefix}/out/")}
    written |= {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    written["stdout+stderr"] = (run.stdout + run.stderr).encode()
    assert len(written) > 8
    for secret in (WRITER[1].encode(), WRITER[0].encode()):
        assert not [name for name, data in written.items() if secret in data], f"{secret!r} was written"


def shard_rows(start: int, stop: int) -> pa.Table:
    from batchrun.job.sink import result_schema
    return pa.Table.from_pylist([{"id": f"r{i}", "status": "ok", "row_index": i, "prompt_tokens": 1,
                                  "completion_tokens": 2, "cached_tokens": 0} for i in range(start, stop)],
                                schema=result_schema(pa.string(), []))


@pytest.mark.parametrize("killed", ["before _merged", "after _merged"])
def test_a_kill_during_the_merge_never_shows_a_row_twice_and_recovers(s3, monkeypatch, killed):
    """output.order: input on an object store, killed while writing the sorted shards (the part shards stay in force)
    or while deleting the part shards (the sorted ones are): readers see each row once, and repair finishes."""
    from batchrun.job.sink import result_schema
    out = Storage(f"{s3.uri}/out")
    store = ObjectShardStore(out)
    for k, (a, b) in enumerate([(5, 10), (0, 5), (10, 23)], 1):
        store.commit(f"part-{k:06d}-{k:016x}.parquet", shard_rows(a, b))
    store.commit("part-000004-0000000000000004.parquet", shard_rows(3, 7))   # rows a second writer also did
    real_commit, real_delete = ObjectShardStore.commit, ObjectShardStore._delete

    def commit(self, name, table):
        if name == "sorted-000003.parquet" and killed == "before _merged":
            raise KeyboardInterrupt("killed")
        return real_commit(self, name, table)

    def delete(self, names):
        if killed == "after _merged":
            real_delete(self, names[:1])
            raise KeyboardInterrupt("killed")
        return real_delete(self, names)
    monkeypatch.setattr(ObjectShardStore, "commit", commit)
    monkeypatch.setattr(ObjectShardStore, "_delete", delete)
    with pytest.raises(KeyboardInterrupt):
        store.sort_by_input(result_schema(pa.string(), []), 10)
    assert sorted(store.read(["row_index"]).column(0).to_pylist()) == list(range(23))
    assert store.counts()["rows_done"] == (27 if killed == "before _merged" else 23)   # the listing counts shards
    monkeypatch.setattr(ObjectShardStore, "commit", real_commit)
    monkeypatch.setattr(ObjectShardStore, "_delete", real_delete)
    store.repair()
    kinds = {kind for kind, _, _ in store.shards()}
    assert kinds == ({"part"} if killed == "before _merged" else {"sorted"})
    assert len([k for k in s3.keys(f"{s3.prefix}/out/data/") if ENTRIES not in k]) == len(store.shards())
    store.sort_by_input(result_schema(pa.string(), []), 10)
    assert store.read(["row_index"]).column(0).to_pylist() == list(range(23))
    assert [name for _, _, name in store.shards()] == [f"sorted-{k:06d}.parquet" for k in (1, 2, 3)]
    assert store.counts() == {"rows_done": 23, "rows_ok": 23, "rows_failed": 0, "prompt_tokens": 23,
                              "completion_tokens": 46}


def test_a_store_without_conditional_put_runs_only_with_force(tmp_path, tiny_model):
    """memory:// (fsspec) has no conditional PUT: refused, naming --force; with --force the job runs."""
    ids = write_prompts(tmp_path / "in.parquet", 5)
    job = write_job(tmp_path, tiny_model[0], output={"path": "memory://batchrun-test/out"})
    from batchrun.job import JobError
    with pytest.raises(JobError, match=r"memory://batchrun-test/out: cannot lock the job's output: batchrun takes its "
                                       r"lock by conditional PUT on s3:// only.*submit with --force") as refused:
        Job.from_yaml(job).run(progress="log")
    assert refused.value.exit_code == EXIT_INVALID
    result = Job.from_yaml(job).run(progress="log", force=True)
    assert result.exit_code == EXIT_OK and sorted(result.table().column("id").to_pylist()) == ids
