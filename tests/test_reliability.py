"""What an overnight cron user meets sooner or later: invalid UTF-8, a relative model path from another directory,
a job that fails before any work, SIGTERM during start-up, an input replaced under a resumable job."""
import json
import os
import shutil
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchrun.engine.llm as llm_module
from batchrun.job import Job, JobError, JobSpec
from batchrun.job.errors import EXIT_INTERRUPTED
from jobkit import write_job, write_prompts


def invalid_utf8(values: list[bytes]) -> pa.Array:
    return pa.array(values, pa.binary()).view(pa.string())   # a view does not validate, as some writers do not


def test_invalid_utf8_fails_its_row_alone_in_parquet_and_jsonl(tmp_path, tiny_model):
    pq.write_table(pa.table({"id": invalid_utf8([b"a", b"b\xff", b"c"]),
                             "prompt": invalid_utf8([b"the fox", b"the dog", b"bad \xfe\xff text"])}),
                   tmp_path / "in.parquet")
    rows = {r["row_index"]: r for r in Job.from_yaml(write_job(tmp_path, tiny_model[0])).run(
        progress="log").table().to_pylist()}
    assert rows[0]["status"] == "ok"
    assert rows[1]["status"] == "error" and "column 'id' holds text that is not valid UTF-8" in rows[1]["error"]
    assert rows[2]["status"] == "error" and "column 'prompt'" in rows[2]["error"]
    good = json.dumps({"custom_id": "x", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}})
    (tmp_path / "in.jsonl").write_bytes(good.encode() + b"\n" + good.replace('"x"', '"y"').encode()[:-20]
                                        + b"\xff\xfe" + b"}}\n")
    rows = Job.from_yaml(write_job(tmp_path, tiny_model[0], name="jsonl", input={"path": "in.jsonl"})).run(
        progress="log").table().to_pylist()
    assert [r["status"] for r in rows] == ["ok", "error"] and "line 2: not valid UTF-8" in rows[1]["error"]


def test_model_path_is_relative_to_the_job_file_and_its_files_are_in_the_identity(tmp_path, tiny_model,
                                                                                  monkeypatch):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    shutil.copytree(tiny_model[0], jobs / "model")
    write_prompts(jobs / "in.parquet", 4)
    job = write_job(jobs, "model")
    elsewhere = tmp_path / "cron"
    (elsewhere / "model").mkdir(parents=True)       # a different "model" in the current directory must not win
    monkeypatch.chdir(elsewhere)
    assert JobSpec.from_yaml(job).model == str(jobs / "model")
    assert Job.from_yaml(job).run(progress="log").exit_code == 0
    state = json.load(open(jobs / "out" / "job" / "job.json"))
    assert state["model_files"][0] == str(jobs / "model") and len(state["model_files"]) == 3
    weights = jobs / "model" / "model.safetensors"
    os.utime(weights, ns=(0, 0))                      # the weights are replaced: a different job
    with pytest.raises(JobError, match="the model's files changed"):
        Job.from_yaml(job).run(progress="log")


def test_a_job_that_cannot_start_claims_nothing(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", 4)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model[0], broken)
    os.remove(broken / "model.safetensors")
    job = write_job(tmp_path, str(broken))
    with pytest.raises(JobError, match=r"model \(line \d+\): no \*\.safetensors file") as info:
        Job.from_yaml(job).run(progress="log")
    assert info.value.exit_code == 2 and not (tmp_path / "out" / "job" / "job.json").exists()
    # validate refuses what submit refuses
    with pytest.raises(JobError, match="no \\*\\.safetensors file"):
        Job.from_yaml(job).validate()
    small = write_job(tmp_path, tiny_model[0], name="small", engine={"kv_cache_memory": "1KiB"})
    with pytest.raises(JobError, match=r"engine.kv_cache_memory \(line \d+\): the KV budget of"):
        Job.from_yaml(small).validate()
    # the fixed job takes the directory without --restart; so does another job over a directory without results
    fixed = write_job(tmp_path, tiny_model[0])
    assert Job.from_yaml(fixed).run(progress="log").exit_code == 0


def test_an_output_without_results_is_free_for_a_different_job(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", 4)
    out = tmp_path / "out" / "job"
    out.mkdir(parents=True)
    (out / "job.json").write_text(json.dumps({"identity": "someone-else", "spec": {}, "inputs": []}))
    assert Job.from_yaml(write_job(tmp_path, tiny_model[0])).run(progress="log").exit_code == 0


def test_sigterm_during_start_up_exits_5_with_nothing_but_complete_files(tmp_path, tiny_model, monkeypatch):
    write_prompts(tmp_path / "in.parquet", 6)
    real_engine = llm_module.Engine

    def loading(*args, **kwargs):                     # the signal lands while the model loads
        os.kill(os.getpid(), signal.SIGTERM)
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(llm_module, "Engine", loading)
    result = Job.from_yaml(write_job(tmp_path, tiny_model[0])).run(progress="log")
    assert result.exit_code == EXIT_INTERRUPTED and result.summary["status"] == "interrupted"
    assert result.summary["rows_done"] == 0 and not [p for p in (tmp_path / "out" / "job").rglob("*.tmp")]


def test_an_input_replaced_under_a_resumable_job_is_refused_naming_the_file(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model[0], output={"shard_rows": 1})
    Job.from_yaml(job).run(progress="log")
    write_prompts(tmp_path / "in.parquet", 5)
    with pytest.raises(JobError) as info:
        Job.from_yaml(job).run(progress="log")
    message = str(info.value)
    assert f"input file {tmp_path / 'in.parquet'} changed" in message
    assert "put the old input file back" in message and "--restart" in message


def test_chat_messages_with_a_null_role_fail_alone(tmp_path, tiny_model):
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    chats = [[{"role": "user", "content": "the fox"}], [{"role": None, "content": "the dog"}]]
    pq.write_table(pa.table({"id": ["a", "b"], "messages": pa.array(chats, messages)}), tmp_path / "in.parquet")
    rows = Job.from_yaml(write_job(tmp_path, tiny_model[0], input={"messages_column": "messages"})).run(
        progress="log").table().to_pylist()
    assert [r["status"] for r in rows] == ["ok", "error"]
    assert rows[1]["error"].startswith("prompt: message 0 needs a string role and content")


def shard_sink(tmp_path, n=23, shard_rows=4):
    from batchrun.job.sink import ResultSink, result_schema
    sink = ResultSink(str(tmp_path), result_schema(pa.string(), []), shard_rows, 3600)
    for i in reversed(range(n)):                     # finish order: the reverse of input order
        sink.add([{"id": f"r{i}", "status": "ok", "row_index": i, "prompt_tokens": 1, "completion_tokens": 1,
                   "cached_tokens": 0}])
    sink.flush()
    return sink


def test_input_order_merge_is_streamed_in_slices(tmp_path, monkeypatch):
    import pyarrow.dataset as ds
    from batchrun.job import sink as sink_module
    monkeypatch.setattr(sink_module, "MERGE_ROWS", 5)
    sink = shard_sink(tmp_path)
    sink.sort_by_input()
    files = sorted(os.listdir(tmp_path / "data"))
    assert files == [f"sorted-{i:06d}.parquet" for i in range(1, 6)]     # 23 rows, 5 row indices per file
    assert ds.dataset(tmp_path / "data").to_table().column("row_index").to_pylist() == list(range(23))
    assert not (tmp_path / ".data.sorting").exists() and not (tmp_path / ".data.old").exists()


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_kill_during_the_merge_never_shows_a_row_twice_and_recovers(tmp_path, monkeypatch, fail_at):
    """Killed at the first rename (shards moved aside) or the second (merged files not yet in place): a reader of
    data/ sees each row once or no directory, and the next run finds every row exactly once."""
    import pyarrow.dataset as ds
    from batchrun.job.sink import ShardStore
    sink = shard_sink(tmp_path)
    real_replace, calls = os.replace, []

    def killed(src, dst):
        if os.path.isdir(src):
            calls.append(src)
            if len(calls) == fail_at:
                raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        sink.sort_by_input()
    monkeypatch.setattr(os, "replace", real_replace)
    if (tmp_path / "data").exists():
        assert ds.dataset(tmp_path / "data").count_rows() == 23
    ShardStore(str(tmp_path)).repair()
    indices = ds.dataset(tmp_path / "data").to_table().column("row_index").to_pylist()
    assert sorted(indices) == list(range(23))


@pytest.mark.parametrize("error", [28, 30])   # ENOSPC (disk full), EROFS (made read-only)
def test_a_failed_write_mid_job_stops_with_exit_5_and_resumes_exactly_once(tmp_path, tiny_model, monkeypatch,
                                                                          error):
    from batchrun.job import sink as sink_module
    ids = write_prompts(tmp_path / "in.parquet", 20)
    job = write_job(tmp_path, tiny_model[0], output={"shard_rows": 3})
    real_write, calls = sink_module.write_shard, []

    def failing(directory, name, table):
        calls.append(name)
        if len(calls) > 2:
            raise OSError(error, os.strerror(error))
        return real_write(directory, name, table)

    monkeypatch.setattr(sink_module, "write_shard", failing)
    stopped = Job.from_yaml(job).run(progress="log")
    assert stopped.exit_code == EXIT_INTERRUPTED and stopped.summary["rows_done"] == 6
    assert os.strerror(error) in open(tmp_path / "out" / "job" / "job.log").read()
    monkeypatch.setattr(sink_module, "write_shard", real_write)
    done = Job.from_yaml(job).run(progress="log")
    assert done.exit_code == 0 and sorted(done.table().column("id").to_pylist()) == ids
