"""A job end to end on CUDA with int8 KV: SIGTERM mid-run, then a resumed submit finishes it, every input id
exactly once (the CPU version: test_job_resume.py's test_lock_and_sigterm)."""
import json
import os
import signal
import time

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from batchrun.job.errors import EXIT_INTERRUPTED, EXIT_OK  # noqa: E402
from jobkit import cli, start_submit, write_job, write_prompts  # noqa: E402
from test_job_resume import assert_exactly_once, committed, wait_for  # noqa: E402


def test_int8_job_on_cuda_resumes_after_sigterm(tmp_path, tiny_model):
    ids = write_prompts(tmp_path / "in.parquet", 400)
    # two requests at a time and small shards: the job is still running when SIGTERM comes
    job = write_job(tmp_path, tiny_model[0], engine={"device": "cuda", "kv_cache_dtype": "int8", "max_num_seqs": 2},
                    sampling={"max_tokens": 16, "ignore_eos": True}, output={"shard_rows": 3, "flush_every_s": 0.5})
    out = str(tmp_path / "out" / "job")
    proc = start_submit(job)
    wait_for(lambda: len(committed(out)) >= 3, proc, timeout=120)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    assert time.monotonic() - start < 10 and "stopped by SIGTERM" in stderr
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["status"] == "interrupted" and summary["kv_cache_dtype"] == "int8"
    assert summary["rows_done"] == len(committed(out)) > 0 and summary["rows_remaining"] > 0
    before = len(committed(out))
    resumed = cli("submit", job, "--progress", "log", "--set", "engine.max_num_seqs=16", timeout=300)
    assert resumed.returncode == EXIT_OK, resumed.stderr
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["kv_cache_dtype"] == "int8" and summary["rows_this_run"] == len(ids) - before
    assert_exactly_once(out, ids)
