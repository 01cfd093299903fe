"""A bfloat16 job in deterministic mode, SIGKILLed at three moments and resumed with a wider batch, gives every row
exactly as an uninterrupted run does (without the mode, 16-bit rows may differ in the last digits, issue 36)."""
import json
import os
import signal

import pyarrow.dataset as ds

from batchrun import Job
from batchrun.job.errors import EXIT_OK
from jobkit import cli, start_submit, write_job, write_prompts
from test_job_resume import assert_exactly_once, committed, wait_for

SECTIONS = {"engine": {"dtype": "bfloat16", "deterministic": True, "max_num_seqs": 2},
            "sampling": {"max_tokens": 12, "ignore_eos": True}, "output": {"shard_rows": 3, "flush_every_s": 0.5}}


def texts(out: str) -> dict[str, str]:
    table = ds.dataset(os.path.join(out, "data")).to_table(columns=["id", "text"]).to_pydict()
    return dict(zip(table["id"], table["text"]))


def test_bf16_job_killed_three_times_gives_the_uninterrupted_rows(tmp_path, tiny_model):
    ids = write_prompts(tmp_path / "in.parquet", 30)
    whole = Job.from_yaml(write_job(tmp_path, tiny_model[0], name="whole", **SECTIONS)).run(progress="log")
    assert whole.exit_code == EXIT_OK
    job = write_job(tmp_path, tiny_model[0], **SECTIONS)
    out = str(tmp_path / "out" / "job")
    for moment in (lambda: os.path.exists(os.path.join(out, ".lock")),   # starting: nothing written
                   lambda: len(committed(out)) >= 3,                       # just after the first shard
                   lambda: len(committed(out)) >= 15):                     # later, rows from an earlier run kept
        proc = start_submit(job)
        wait_for(moment, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert 0 < len(committed(out)) < len(ids)
    final = cli("submit", job, "--progress", "log", "--set", "engine.max_num_seqs=16")   # other batches, same rows
    assert final.returncode == EXIT_OK, final.stderr
    assert_exactly_once(out, ids)
    assert texts(out) == texts(whole.output_dir)
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["deterministic"] is True and summary["compute_dtype"] == "bfloat16"
    state = json.load(open(os.path.join(out, "job.json")))
    assert state["spec"]["deterministic"] is True
