"""Adapters in jobs: engine.adapters relative to the job file, input.adapter_column, sampling.adapter, OpenAI batch
body.model; killed and resumed, every id once and outputs equal to an uninterrupted run; a changed adapter refuses
resume; an unknown name fails its row alone; a bad adapter file fails the job before any work."""
import json
import os
import signal

import pyarrow.dataset as ds
import pytest

from batchrun import Job
from batchrun.job.errors import EXIT_INVALID, JobError
from jobkit import cli, start_submit, write_job, write_prompts
from lora_kit import ADAPTERS, make_adapter
from test_job_resume import assert_exactly_once, committed, wait_for

NAMES = [None, "support", "invoices", "qv"]


def adapters_beside(tmp_path, base) -> dict[str, str]:
    """The test adapters saved under tmp_path/adapters; their paths relative to the job file."""
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        make_adapter(base, tmp_path / "adapters" / name, 10 + i, **spec)
    return {name: f"adapters/{name}" for name in ADAPTERS}


def results(out: str) -> dict:
    table = ds.dataset(os.path.join(out, "data")).to_table(columns=["id", "status", "text", "error"]).to_pylist()
    return {r["id"]: r for r in table}


def test_adapter_column_killed_and_resumed(tmp_path, tiny_model):
    path, base = tiny_model
    column = [NAMES[i % 4] for i in range(24)]
    column[5] = "nope"
    ids = write_prompts(tmp_path / "in.parquet", 24, adapter=column)
    engine = {"adapters": adapters_beside(tmp_path, base), "max_num_seqs": 2}
    job = write_job(tmp_path, path, engine=engine, input={"adapter_column": "adapter"},
                    sampling={"max_tokens": 12, "ignore_eos": True}, output={"shard_rows": 3, "flush_every_s": 0.5})
    straight = Job.from_yaml(job, ["output.path=out/straight"]).run(progress="log")
    assert straight.summary["rows_failed"] == 1
    out = str(tmp_path / "out" / "job")
    proc = start_submit(job)
    wait_for(lambda: len(committed(out)) >= 6, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(committed(out)) < len(ids)
    Job.from_yaml(job).run(progress="log")
    assert_exactly_once(out, ids)
    got, want = results(out), results(str(tmp_path / "out" / "straight"))
    assert {i: r["text"] for i, r in got.items()} == {i: r["text"] for i, r in want.items()}
    assert got["row-005"]["status"] == "error" and "unknown adapter 'nope'" in got["row-005"]["error"]
    assert sum(r["status"] == "ok" for r in got.values()) == len(ids) - 1
    # rows under an adapter differ from the same prompts on the base model, base rows do not
    Job.from_yaml(job, ["input.adapter_column=null", "input.limit=8", "output.path=out/base"]).run(progress="log")
    base_text = results(str(tmp_path / "out" / "base"))
    assert all((got[i]["text"] == base_text[i]["text"]) == (column[k] is None)
               for k, i in enumerate(ids[:8]) if column[k] != "nope")

    # a changed adapter file is a different job: resume refuses, naming the adapter
    make_adapter(base, tmp_path / "adapters" / "qv", 99, **ADAPTERS["qv"])
    with pytest.raises(JobError, match=r"holds results of a different job \(adapters.qv: "):
        Job.from_yaml(job).run(progress="log")


def test_sampling_default_and_openai_batch_model(tmp_path, tiny_model):
    path, base = tiny_model
    adapters = adapters_beside(tmp_path, base)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": "the quick brown fox", "max_tokens": 5}}
             for i, model in enumerate(["support", path, None, "qv", "missing"])]
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    job = write_job(tmp_path, path, input={"path": "in.jsonl"}, engine={"adapters": adapters},
                    sampling={"adapter": "invoices", "ignore_eos": True})
    Job.from_yaml(job).run(progress="log")
    got = results(str(tmp_path / "out" / "job"))
    assert got["r4"]["status"] == "error" and "unknown adapter 'missing'" in got["r4"]["error"]
    # the base model's name and no model both fall back to sampling.adapter (invoices)
    assert got["r1"]["text"] == got["r2"]["text"]
    assert len({got[r]["text"] for r in ("r0", "r2", "r3")}) == 3


def test_bad_adapter_fails_before_any_work(tmp_path, tiny_model):
    path, base = tiny_model
    write_prompts(tmp_path / "in.parquet", 4)
    adapters = adapters_beside(tmp_path, base)
    os.remove(tmp_path / "adapters" / "qv" / "adapter_model.safetensors")
    result = cli("submit", write_job(tmp_path, path, engine={"adapters": adapters}), "--progress", "log")
    assert result.returncode == EXIT_INVALID
    assert "engine.adapters" in result.stderr and "adapter 'qv'" in result.stderr
    assert str(tmp_path / "adapters" / "qv" / "adapter_model.safetensors") in result.stderr
    assert not os.path.exists(tmp_path / "out" / "job" / "data")


def test_planner_counts_adapter_memory(tmp_path, tiny_model):
    """max_adapters of the largest adapter, once (as a GPU engine holds it), in 16-bit, B over the whole fused
    q/k/v or gate/up projection's rows (block-diagonal there)."""
    from safetensors.torch import load_file

    from batchrun.job.spec import JobSpec
    from batchrun.planner.api import make_planner
    path, base = tiny_model
    write_prompts(tmp_path / "in.parquet", 4)
    adapters = adapters_beside(tmp_path, base)
    config = base.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    gate_up = 2 * config.intermediate_size
    fused = {"q_proj": qkv, "k_proj": qkv, "v_proj": qkv, "gate_proj": gate_up, "up_proj": gate_up}
    tensors = load_file(tmp_path / "adapters" / "invoices" / "adapter_model.safetensors")
    largest = 2 * sum(t.numel() if ".lora_A" in name else
                      t.shape[1] * fused.get(name.split(".lora_B")[0].rpartition(".")[2], t.shape[0])
                      for name, t in tensors.items())
    for limit, held in ((None, 3), (1, 1)):
        engine = {"adapters": adapters, **({"max_adapters": limit} if limit else {})}
        planner = make_planner(JobSpec.from_yaml(write_job(tmp_path, path, engine=engine)))
        assert planner.adapter_bytes == held * largest