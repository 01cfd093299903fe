"""End to end on the tiny model: each input format, the Python handle, outputs, resume refusal, status."""
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from batchrun import Job
from batchrun.job.errors import EXIT_INVALID
from click.testing import CliRunner

from batchrun.cli import main
from jobkit import write_job, write_prompts


def test_plain_job_outputs_and_python_handle(tmp_path, tiny_model):
    ids = write_prompts(tmp_path / "in.parquet", 24, topic=[f"t{i % 3}" for i in range(24)])
    job = write_job(tmp_path, tiny_model[0], input={"passthrough": ["topic"]}, sampling={"ignore_eos": True})
    result = Job.from_yaml(job).run(progress="log")
    assert result.exit_code == 0
    table = result.table()
    assert table.column("id").to_pylist() == ids
    assert {"id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "status", "error", "latency",
            "topic"} <= set(table.column_names)
    assert set(table.column("completion_tokens").to_pylist()) == {6} and table.column("topic")[4].as_py() == "t1"
    out = result.output_dir
    assert ds.dataset(os.path.join(out, "data")).count_rows() == 24 and len(os.listdir(os.path.join(out, "data"))) > 1
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["rows_ok"] == 24 and summary["completion_tokens"] == 24 * 6 and summary["output_tokens_per_s"] > 0
    assert {"kv_blocks_peak", "kv_blocks_total", "preemptions", "wall_s"} <= set(summary)
    prom = open(os.path.join(out, "metrics.prom")).read()
    assert 'batchrun_job_rows{job="job",status="ok"} 24.0' in prom and "# TYPE batchrun_job_exit_code gauge" in prom
    assert "24 ok, 0 failed" in open(os.path.join(out, "job.log")).read()


def test_bucketing_off_gives_the_same_greedy_results(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", 16)
    on = Job.from_yaml(write_job(tmp_path, tiny_model[0], name="on")).run(progress="log").table()
    off = Job.from_yaml(write_job(tmp_path, tiny_model[0], name="off", batching={"bucketing": False})).run(
        progress="log").table()
    assert on.column("text").to_pylist() == off.column("text").to_pylist()


def test_template_and_input_order(tmp_path, tiny_model):
    pq.write_table(pa.table({"n": pa.array(range(12, 0, -1), pa.int64()), "title": ["fox"] * 12,
                             "body": ["the lazy dog " * (i % 5 + 1) for i in range(12)]}), tmp_path / "in.parquet")
    job = write_job(tmp_path, tiny_model[0], input={"id_column": "n", "template": "Summarize {title}: {body}",
                                                    "passthrough": ["title"]}, output={"order": "input"})
    result = Job.from_yaml(job).run(progress="log")
    files = os.listdir(os.path.join(result.output_dir, "data"))
    assert files == ["sorted-000001.parquet"]
    assert pq.read_table(os.path.join(result.output_dir, "data")).column("id").to_pylist() == list(range(12, 0, -1))


def test_chat_messages_with_system_prompt(tmp_path, tiny_model):
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    chats = [[{"role": "user", "content": "the quick brown fox"}],
             [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fox"},
              {"role": "user", "content": "dog"}], []]
    pq.write_table(pa.table({"id": ["a", "b", "c"], "messages": pa.array(chats, messages)}), tmp_path / "in.parquet")
    job = write_job(tmp_path, tiny_model[0], input={"messages_column": "messages", "system_prompt": "Be brief."})
    rows = Job.from_yaml(job).run(progress="log").table().to_pylist()
    from conftest import tiny_tokenizer
    expected = tiny_tokenizer().apply_chat_template([{"role": "system", "content": "Be brief."}, *chats[0]],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False)
    assert rows[0]["prompt_tokens"] == len(expected) and rows[0]["status"] == "ok"
    assert rows[2]["status"] == "error" and rows[2]["error"] == "prompt: null or empty"


def test_openai_batch_in_and_out(tmp_path, tiny_model):
    lines = [{"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "x", "messages": [{"role": "user", "content": "fox"}], "max_tokens": 3}},
             {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
              "body": {"model": "x", "prompt": "the dog", "max_tokens": 5, "temperature": 0.5, "seed": 3}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": 7}}]
    (tmp_path / "req.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = write_job(tmp_path, tiny_model[0], input={"path": "req.jsonl"}, output={"openai_batch": True},
                    sampling={"ignore_eos": True})
    result = Job.from_yaml(job).run(progress="log")
    out = [json.loads(line) for line in open(os.path.join(result.output_dir, "output.jsonl"))]
    assert [o["custom_id"] for o in out] == ["chat-1", "cmpl-1", "bad"]
    chat, cmpl, bad = out
    assert chat["response"]["status_code"] == 200 and chat["error"] is None
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["usage"]["completion_tokens"] == 3
    assert isinstance(chat["response"]["body"]["choices"][0]["message"]["content"], str)
    assert cmpl["response"]["body"]["usage"]["completion_tokens"] == 5 and "text" in cmpl["response"]["body"]["choices"][0]
    assert bad["response"] is None and "body.prompt must be a string" in bad["error"]["message"]


def cli(*args):
    return CliRunner().invoke(main, list(args))


def test_changed_spec_refused_unless_restart_and_status(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", 10)
    job = write_job(tmp_path, tiny_model[0])
    assert json.loads(cli("status", job).stdout)["state"] == "not started"
    first = cli("submit", job, "--set", "input.limit=6")
    assert first.exit_code == 0, first.output
    assert json.loads(first.stdout.splitlines()[-1])["rows_ok"] == 6
    refused = cli("submit", job)
    assert refused.exit_code == EXIT_INVALID
    assert "holds results of a different job (input.limit: 6 -> None)" in refused.stderr and "--restart" in refused.stderr
    assert "submit would refuse" in json.loads(cli("validate", job).stdout)["output_state"]
    restarted = cli("submit", job, "--restart")
    assert restarted.exit_code == 0 and json.loads(restarted.stdout.splitlines()[-1])["rows_ok"] == 10
    status = json.loads(cli("status", job).stdout)
    assert status["state"] == "done" and status["rows_done"] == 10 and status["rows_remaining"] == 0 and status["rows_failed"] == 0


def test_status_does_not_import_torch(tmp_path, tiny_model):
    """`batchrun status` is what a cron checks every few minutes: importing torch would cost it 2-3 s."""
    write_prompts(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model[0])
    probe = ("import json, sys; from batchrun.cli import main; from batchrun.job import Job; "
             f"state = Job.from_yaml({job!r}).status()['state']; print(json.dumps([state, 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["not started", False]


def test_generate_is_a_job_made_from_flags(tmp_path, tiny_model):
    """`batchrun generate` writes the job's output (columns, summary), resumes, and names the flag of a bad value."""
    budgets = [2 + i % 4 for i in range(10)]
    write_prompts(tmp_path / "in.parquet", 10, max_tokens=pa.array(budgets, pa.int64()))
    out = tmp_path / "gen"
    args = ["generate", str(tmp_path / "in.parquet"), "--model", tiny_model[0], "--output", str(out), "--limit", "8",
            "--kv-cache-memory", "4MiB", "--max-num-seqs", "4", "--progress", "log"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert json.loads(first.output.strip().splitlines()[-1])["rows_ok"] == 8
    table = pq.read_table(out / "data").sort_by("row_index")
    assert table.column("id").to_pylist() == [f"row-{i:03d}" for i in range(8)]
    assert {"status", "finish_reason", "completion_tokens", "time_to_first_token", "row_index"} <= set(table.column_names)
    lengths = [(r["completion_tokens"], budgets[r["row_index"]]) for r in table.to_pylist()
               if r["finish_reason"] == "length"]
    assert lengths and all(n == budget for n, budget in lengths)   # the file's max_tokens column, per row
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and json.load(open(out / "summary.json"))["rows_this_run"] == 0
    bad = CliRunner().invoke(main, args[:-2] + ["--max-tokens", "0"])
    assert bad.exit_code == EXIT_INVALID
    assert "Invalid value for '--max-tokens': must be an integer >= 1, got '0'" in bad.output


def test_metrics_textfile_escapes_labels_and_parses(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families
    from batchrun.job.report import write_metrics
    name = 'night "run" \\ 2'
    write_metrics(str(tmp_path / "metrics.prom"), dict(job=name, rows_ok=3, rows_failed=1, rows_remaining=None,
                  prompt_tokens=40, completion_tokens=12, wall_s=1.5, output_tokens_per_s=8.0, preemptions=0,
                  kv_blocks_peak=7, exit_code=3))
    samples = {(s.name, s.labels.get("status")): s for f in text_string_to_metric_families(
        (tmp_path / "metrics.prom").read_text()) for s in f.samples}
    assert samples[("batchrun_job_rows", "error")].value == 1 and samples[("batchrun_job_exit_code", None)].value == 3
    assert all(s.labels["job"] == name for s in samples.values())
    assert samples[("batchrun_job_rows_remaining", None)].value != samples[("batchrun_job_rows_remaining", None)].value
    assert not [p for p in tmp_path.iterdir() if p.name != "metrics.prom"]   # written through a renamed temp file
