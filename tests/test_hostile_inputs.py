"""Hostile inputs, one case per class of the fuzzing campaign: every value is checked at one door (SamplingParams)
whichever surface it came through; a job-level value refuses the job before any work, a row-level value fails that
row alone naming where it came from; CLI flags out of range are usage errors, never tracebacks."""
from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.job import Job, JobError
from jobkit import cli, write_job, write_prompts


def test_a_job_level_value_the_engine_could_not_use_refuses_the_job_before_any_work(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", 4)
    for sampling, message in [({"seed": 2**70}, r"sampling\.seed \(line \d+\): must be an integer in"),
                              ({"temperature": float("nan")}, r"sampling\.temperature \(line \d+\): must be a finite"),
                              ({"top_p": float("inf")}, r"sampling\.top_p \(line \d+\): must be a number in \(0, 1\]"),
                              ({"stop": ["ok", 3]}, r"sampling\.stop \(line \d+\): must be a list of strings"),
                              ({"regex": r"[^\s\S]"}, r"sampling\.regex \(line \d+\): no text can satisfy it")]:
        job = write_job(tmp_path, tiny_model[0], name="bad", sampling=sampling)
        done = cli("validate", job)
        assert done.returncode == 2 and re.search(message, done.stderr), (sampling, done.stderr)
        assert "Traceback" not in done.stderr


def test_row_values_fail_their_row_alone_naming_the_column(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", 5, temp=[0.0, float("nan"), float("inf"), 0.0, 0.0],
                  seed=pa.array([1, 2, 3, 2**64 - 1, 5], pa.uint64()))
    job = write_job(tmp_path, tiny_model[0], input={"temperature_column": "temp", "seed_column": "seed"})
    result = Job.from_yaml(job).run(progress="log")
    rows = {r["row_index"]: r for r in result.table().to_pylist()}
    assert [rows[i]["status"] for i in range(5)] == ["ok", "error", "error", "ok", "ok"]
    assert rows[1]["error"] == "temperature (column 'temp'): must be a finite number >= 0 (0 means greedy), got nan"
    assert all(rows[i]["text"] for i in (0, 3, 4))


def test_a_wrong_type_deep_in_one_jsonl_body_fails_that_line_alone(tmp_path, tiny_model):
    def line(custom_id, **body):
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": "hello", "max_tokens": 3, **body}})
    (tmp_path / "in.jsonl").write_text("\n".join([
        line("a"), line("b", stop=[1, 2]), line("c", temperature=float("nan")), line("d", seed=2**70),
        line("e", n=2, seed=2**64 - 1, temperature=1.0), line("f", max_tokens=[3]),
        line("g", response_format={"type": "json_schema", "json_schema": {"schema": {"enum": []}}}),
        line("h", response_format={"type": "json_schema", "json_schema": {"schema": {
            "type": "string", "pattern": r"[^\s\S]"}}})]) + "\n")
    job = write_job(tmp_path, tiny_model[0], input={"path": "in.jsonl"})
    result = Job.from_yaml(job).run(progress="log")
    rows = {}
    for r in result.table().to_pylist():
        rows.setdefault(r["id"], []).append(r)
    assert [r["status"] for r in rows["a"]] == ["ok"] and [r["status"] for r in rows["e"]] == ["ok", "ok"]
    errors = {k: v[0]["error"] for k, v in rows.items() if v[0]["status"] == "error"}
    assert errors == {
        "b": "in.jsonl line 2: body.stop: must be a list of strings; item 0 is 1",
        "c": "in.jsonl line 3: body.temperature: must be a finite number >= 0 (0 means greedy), got nan",
        "d": "in.jsonl line 4: body.seed: must be an integer in [-9223372036854775808, 18446744073709551615], "
             "got 1180591620717411303424",
        "f": "in.jsonl line 6: body.max_tokens: must be a positive integer, got [3]",
        "g": "in.jsonl line 7: body.response_format: enum array must not be empty",
        "h": "structured output: no text satisfies the constraint after the output so far (the grammar allows no "
             "next token)"}


def test_text_columns_in_any_arrow_layout(tmp_path, tiny_model):
    """pandas writes a 'category' column dictionary-encoded; other writers use large_string or string_view."""
    pq.write_table(pa.table({
        "id": pa.array(["a", "b", "c"]).dictionary_encode(),
        "prompt": pa.array(["hello there", "hi", "the fox"]).dictionary_encode(),
        "topic": pa.array(["x", "y", "x"], pa.large_string()),
        "note": pa.array(["p", "q", "r"], pa.string_view())}), tmp_path / "in.parquet")
    job = write_job(tmp_path, tiny_model[0], input={"passthrough": ["topic", "note"]})
    table = Job.from_yaml(job).run(progress="log").table()
    assert table.schema.field("id").type == pa.string()
    rows = sorted(table.to_pylist(), key=lambda r: r["id"])
    assert [(r["id"], r["status"], r["topic"], r["note"]) for r in rows] == [
        ("a", "ok", "x", "p"), ("b", "ok", "y", "q"), ("c", "ok", "x", "r")]


@pytest.mark.parametrize("flags, message", [
    (["--max-num-seqs", "-5"], "Invalid value for '--max-num-seqs': must be an integer >= 1, got '-5'"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--pilot-fraction", "nan"], "'--pilot-fraction': must be a number in (0, 1], got 'nan'"),
    (["--utilization", "nan"], "--utilization"),
    (["--price", "H100=nan"], "--price: expected NAME=USD_PER_HOUR with a positive price"),
    (["--headroom", "nan", "--interactive-rate", "1", "--deadline", "6h"], "--headroom"),
    (["--interactive-prompt-tokens", "0", "--interactive-rate", "1", "--deadline", "6h"],
     "--interactive-prompt-tokens")])
def test_plan_flags_out_of_range_are_usage_errors(tmp_path, tiny_model, flags, message):
    write_prompts(tmp_path / "in.parquet", 4)
    done = cli("plan", write_job(tmp_path, tiny_model[0]), *flags)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_messages_name_the_schema_file_and_print_no_python_reprs(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", 4)
    (tmp_path / "range.json").write_text('{"type": "string", "minLength": 5, "maxLength": 2}')
    (tmp_path / "list.json").write_text("[1, 2]")
    for name, message in [("range.json", "range.json: minLength 5 is greater than maxLength 2"),
                          ("list.json", "list.json holds a JSON array, not a JSON schema (an object)")]:
        with pytest.raises(JobError) as info:
            Job.from_yaml(write_job(tmp_path, tiny_model[0], sampling={"json_schema_file": name}))
        assert "sampling.json_schema_file" in str(info.value) and message in str(info.value)
    job = write_job(tmp_path, tiny_model[0])
    with open(job, "a") as f:
        f.write("deadline: 2030-01-31\n")
    done = cli("validate", job)
    assert done.returncode == 2 and "got 2030-01-31" in done.stderr and "<class" not in done.stderr
    assert "Warning" not in done.stderr
