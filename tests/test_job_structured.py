"""Jobs with structured outputs (schema inline, from a file, per row; parse_json) and with n samples per row."""
import collections
import json
import os
import signal

import jsonschema
import pyarrow.compute as pc
import pyarrow.dataset as ds

from batchrun import Job
from batchrun.job.errors import EXIT_FAILED_ROWS, EXIT_INVALID, EXIT_OK
from jobkit import cli, start_submit, write_job, write_prompts
from test_job_resume import committed, wait_for

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["label", "score"], "additionalProperties": False}


def test_schema_file_and_parse_json(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", 12)
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    job = write_job(tmp_path, tiny_model[0], sampling={"json_schema_file": "schema.json", "max_tokens": 40,
                                                       "temperature": 1.0, "seed": 3},
                    output={"parse_json": True})
    result = Job.from_yaml(job).run(progress="log")
    rows = result.table().to_pylist()
    assert len(rows) == 12
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) >= 9, [(r["finish_reason"], r["text"]) for r in rows]
    for r in ok:
        assert r["finish_reason"] == "stop"
        jsonschema.validate(json.loads(r["json"]), SCHEMA)
    for r in rows:
        if r["status"] == "error":   # cut by max_tokens: failed, with the text kept for a look
            assert r["finish_reason"] == "length" and r["error"].startswith("length: incomplete JSON"), r
    assert result.exit_code == (EXIT_OK if len(ok) == 12 else EXIT_FAILED_ROWS)


def test_schema_per_row_bad_one_fails_alone(tmp_path, tiny_model):
    schemas = [json.dumps(SCHEMA)] * 5 + ['{"type": "objectx"}'] + [json.dumps({"enum": ["yes", "no"]})] * 2
    write_prompts(tmp_path / "in.parquet", 8, schema=schemas)
    job = write_job(tmp_path, tiny_model[0], input={"json_schema_column": "schema"},
                    sampling={"max_tokens": 40}, output={"parse_json": True, "order": "input"})
    result = Job.from_yaml(job).run(progress="log")
    rows = result.table().to_pylist()
    assert rows[5]["status"] == "error" and "json_schema" in rows[5]["error"] and "objectx" in rows[5]["error"]
    for r in rows[6:]:
        assert r["status"] == "ok" and json.loads(r["json"]) in ("yes", "no")
    for r in rows[:5]:
        if r["status"] == "ok":
            jsonschema.validate(json.loads(r["json"]), SCHEMA)


def test_bad_schema_in_the_job_fails_before_any_work(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model[0], sampling={"json_schema": {"type": "objectx"}})
    res = cli("submit", job)
    assert res.returncode == EXIT_INVALID and "sampling.json_schema" in res.stderr and "objectx" in res.stderr
    assert not os.path.exists(tmp_path / "out" / "job" / "data")
    job = write_job(tmp_path, tiny_model[0], name="file", sampling={"json_schema_file": "missing.json"})
    res = cli("submit", job)
    assert res.returncode == EXIT_INVALID and "sampling.json_schema_file" in res.stderr


def test_n_samples_rows_and_resume_exactly_once(tmp_path, tiny_model):
    ids = write_prompts(tmp_path / "in.parquet", 16)
    job = write_job(tmp_path, tiny_model[0], engine={"max_num_seqs": 6},
                    sampling={"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 10, "ignore_eos": True},
                    output={"shard_rows": 6, "flush_every_s": 0.5})
    out = str(tmp_path / "out" / "job")
    proc = start_submit(job)
    wait_for(lambda: len(committed(out)) >= 6, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    res = cli("submit", job, "--progress", "log")
    assert res.returncode == EXIT_OK, res.stderr
    table = ds.dataset(os.path.join(out, "data")).to_table()
    pairs = collections.Counter(zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist()))
    assert set(pairs) == {(i, k) for i in ids for k in range(3)} and set(pairs.values()) == {1}
    texts = collections.defaultdict(set)
    for i, t in zip(table.column("id").to_pylist(), table.column("text").to_pylist()):
        texts[i].add(t)
    assert sum(len(t) > 1 for t in texts.values()) >= 12   # samples differ
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["rows_ok"] == 16 and summary["rows_remaining"] == 0
    # a prompt counts once however many samples it has; every sample's output counts
    first = table.filter(pc.equal(table.column("sample_index"), 0))
    assert summary["prompt_tokens"] == pc.sum(first.column("prompt_tokens")).as_py()
    assert summary["completion_tokens"] == 16 * 3 * 10


def test_openai_batch_n_and_response_format(tmp_path, tiny_model):
    body = {"model": "x", "messages": [{"role": "user", "content": "fox"}], "max_tokens": 40}
    lines = [{"custom_id": "two", "method": "POST", "url": "/v1/chat/completions",
              "body": {**body, "n": 2, "temperature": 1.0, "seed": 1, "max_tokens": 4}},
             {"custom_id": "schema", "method": "POST", "url": "/v1/chat/completions",
              "body": {**body, "response_format": {"type": "json_schema", "json_schema": {"name": "s",
                                                                                          "schema": SCHEMA}}}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
              "body": {**body, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}}]
    (tmp_path / "req.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = write_job(tmp_path, tiny_model[0], input={"path": "req.jsonl"}, output={"openai_batch": True})
    result = Job.from_yaml(job).run(progress="log")
    out = {o["custom_id"]: o for o in map(json.loads, open(os.path.join(result.output_dir, "output.jsonl")))}
    two = out["two"]["response"]["body"]
    assert [c["index"] for c in two["choices"]] == [0, 1] and two["usage"]["completion_tokens"] == 8
    answer = out["schema"]["response"]["body"]["choices"][0]
    if answer["finish_reason"] == "stop":
        jsonschema.validate(json.loads(answer["message"]["content"], strict=False), SCHEMA)
    assert out["bad"]["response"] is None and "body.response_format" in out["bad"]["error"]["message"]
