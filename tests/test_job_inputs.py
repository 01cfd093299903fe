"""Bad input: job-level problems fail before any work (exit 2, naming file and column); bad rows fail alone."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.job import Job, JobError
from jobkit import write_job, write_prompts


@pytest.fixture
def no_model(monkeypatch):
    import batchrun.engine.engine as engine_module
    monkeypatch.setattr(engine_module.Engine, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))


def job_error(job: str) -> str:
    with pytest.raises(JobError) as info:
        Job.from_yaml(job).run(progress="log")
    assert info.value.exit_code == 2
    return str(info.value)


def test_missing_and_corrupt_files(tmp_path, tiny_model, no_model):
    assert "input.path (line" in job_error(write_job(tmp_path, tiny_model[0], input={"path": "nope.parquet"}))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    message = job_error(write_job(tmp_path, tiny_model[0], input={"path": "bad.parquet"}))
    assert "bad.parquet: not a readable Parquet file" in message


@pytest.mark.parametrize("table, input_spec, message", [
    (dict(key=["a"], prompt=["p"]), {}, "no column 'id' (input.id_column); columns: key, prompt"),
    (dict(id=["a"], text=["p"]), {}, "no column 'prompt' (input.prompt_column)"),
    (dict(id=[1.5], prompt=["p"]), {}, "column 'id' (input.id_column) must hold strings or integers, but its type is double"),
    (dict(id=["a"], prompt=[3]), {}, "column 'prompt' (input.prompt_column) must hold text (string)"),
    (dict(id=["a"], prompt=["p"], mt=["x"]), {"max_tokens_column": "mt"}, "column 'mt' (input.max_tokens_column) must hold integers, but its type is string"),
    (dict(id=["a"], prompt=["p"]), {"messages_column": "prompt", "prompt_column": None}, "must hold chat messages"),
    (dict(id=["a"], body=["p"]), {"template": "Say {body} {title}", "prompt_column": None}, "no column 'title' (input.template)"),
    (dict(id=["a"], prompt=["p"]), {"passthrough": ["topic"]}, "no column 'topic' (input.passthrough)"),
])
def test_schema_errors_name_file_and_column(tmp_path, tiny_model, no_model, table, input_spec, message):
    pq.write_table(pa.table(table), tmp_path / "in.parquet")
    assert message in job_error(write_job(tmp_path, tiny_model[0], input={"path": "in.parquet", **input_spec}))


def test_duplicate_ids_refused_naming_them(tmp_path, tiny_model, no_model):
    pq.write_table(pa.table({"id": ["a", "b", "a", "c", "b"], "prompt": ["p"] * 5}), tmp_path / "in.parquet")
    assert ("duplicate ids in the input: 'a' at in.parquet row 0 and in.parquet row 2; 'b' at in.parquet row 1 and "
            "in.parquet row 4") in job_error(write_job(tmp_path, tiny_model[0]))


def test_unwritable_output_fails_early(tmp_path, tiny_model, no_model):
    write_prompts(tmp_path / "in.parquet", 3)
    (tmp_path / "file").write_text("not a directory")
    assert "output.path (line" in job_error(write_job(tmp_path, tiny_model[0], output={"path": "file/out"}))


def test_bad_rows_fail_alone(tmp_path, tiny_model):
    long_prompt = "the quick brown fox " * 200   # longer than the tiny model's 512-token context
    pq.write_table(pa.table({
        "id": [f"r{i}" for i in range(7)],
        "prompt": ["hello there", None, "   ", long_prompt, "fine prompt", "ok", "also ok"],
        "mt": pa.array([4, 4, 4, 4, -2, None, 5], pa.int64()),
        "temp": [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0]}), tmp_path / "in.parquet")
    job = write_job(tmp_path, tiny_model[0], input={"max_tokens_column": "mt", "temperature_column": "temp"})
    result = Job.from_yaml(job).run(progress="log")
    rows = {r["id"]: r for r in result.table().to_pylist()}
    assert result.exit_code == 3 and result.summary["rows_failed"] == 5 and result.summary["rows_ok"] == 2
    assert rows["r0"]["status"] == rows["r5"]["status"] == "ok" and rows["r5"]["completion_tokens"] == 6
    assert rows["r1"]["error"] == rows["r2"]["error"] == "prompt: null or empty"
    assert "does not fit the context of 512 tokens; set input.truncate" in rows["r3"]["error"]
    assert rows["r4"]["error"] == "max_tokens (column 'mt'): must be a positive integer, got -2"
    assert rows["r6"]["error"].startswith("temperature (column 'temp'): must be a finite number >= 0")
    truncated = Job.from_yaml(job, ["input.truncate=left", "output.path=out/trunc"]).run(progress="log").table()
    row = truncated.filter(pa.compute.equal(truncated["id"], "r3")).to_pylist()[0]
    assert row["status"] == "ok" and row["prompt_tokens"] == 512 - 4


def test_malformed_jsonl_lines_fail_alone(tmp_path, tiny_model):
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 3}}
    lines = [json.dumps(good), "{not json", json.dumps({**good, "custom_id": "b", "url": "/v1/embeddings"}),
             json.dumps({**good, "custom_id": "c", "body": {"messages": "hi"}, "url": "/v1/chat/completions"}),
             json.dumps({**good, "custom_id": "d", "body": {"prompt": "x", "temperature": -1}}), json.dumps(good)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    job = write_job(tmp_path, tiny_model[0], input={"path": "in.jsonl", "allow_duplicate_ids": True})
    rows = Job.from_yaml(job).run(progress="log").table().to_pylist()
    assert [r["status"] for r in rows] == ["ok", "error", "error", "error", "error", "ok"]
    assert rows[1]["id"] == "line-2" and "in.jsonl line 2: not valid JSON" in rows[1]["error"]
    assert "url '/v1/embeddings' is not supported" in rows[2]["error"]
    assert "body.messages must be a list" in rows[3]["error"]
    assert rows[4]["error"].startswith("in.jsonl line 5: body.temperature: must be a finite number >= 0")
    assert "duplicate ids in the input: 'a' at in.jsonl line 1 and in.jsonl line 6" in job_error(
        write_job(tmp_path, tiny_model[0], name="strict", input={"path": "in.jsonl"}))
