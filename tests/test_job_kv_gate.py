"""The KV quality gate of a job and `batchrun kvcheck`, on the tiny model."""
import json
import os

import pytest
from click.testing import CliRunner

from batchrun import Job
from batchrun.cli import main
from batchrun.job.errors import EXIT_GATE_FAILED, JobError
from jobkit import write_job, write_prompts

STRICT = {"sample": 6, "min_identical": 1.0}   # fp8 on the chaotic tiny model diverges within 40 tokens


def gate_job(tmp_path, model, gate, dtype="fp8", name="job"):
    write_prompts(tmp_path / "in.parquet", 12)
    return write_job(tmp_path, model, name=name, engine={"kv_cache_dtype": dtype}, kv_quality_gate=gate,
                     sampling={"max_tokens": 40, "ignore_eos": True})


def test_gate_passes_and_is_reported(tmp_path, tiny_model):
    # int8 (rotated) on the tiny model keeps 2 of these 4 greedy outputs identical over 40 tokens: a gate at 50 %
    # passes; a lower fraction (worse 8-bit KV) fails this test.
    job = gate_job(tmp_path, tiny_model[0], {"sample": 4, "min_identical": 0.5}, dtype="int8")
    result = Job.from_yaml(job).run(progress="log")
    assert result.exit_code == 0
    summary = json.load(open(os.path.join(result.output_dir, "summary.json")))
    gate = summary["kv_quality_gate"]
    assert gate["passed"] and gate["action"] == "kept" and summary["kv_cache_dtype"] == "int8"
    report = gate["report"]
    assert report["requests"] == 4 and report["identical_fraction"] >= 0.5 and report["kv_cache_dtype"] == "int8"
    assert gate["reason"] == (f"{report['identical_fraction']:.1%} identical greedy outputs on 4 sample prompts "
                              ">= min_identical 50.0%")


def test_gate_failure_stops_before_any_row(tmp_path, tiny_model):
    job = gate_job(tmp_path, tiny_model[0], {**STRICT, "on_fail": "stop"})
    with pytest.raises(JobError, match=r"kv_quality_gate.*failed: .* identical greedy outputs on 6 sample prompts "
                                       r"< min_identical 100.0%") as err:
        Job.from_yaml(job).run(progress="log")
    assert err.value.exit_code == EXIT_GATE_FAILED
    assert not os.path.exists(tmp_path / "out" / "job" / "data") or not os.listdir(tmp_path / "out" / "job" / "data")


def test_gate_failure_falls_back_to_unquantized_kv(tmp_path, tiny_model):
    job = gate_job(tmp_path, tiny_model[0], {**STRICT, "on_fail": "fallback", "fallback_dtype": "float16"})
    result = Job.from_yaml(job).run(progress="log")
    summary = json.load(open(os.path.join(result.output_dir, "summary.json")))
    assert result.exit_code == 0 and summary["rows_ok"] == 12
    assert summary["kv_quality_gate"]["action"] == "fallback" and summary["kv_cache_dtype"] == "float16"


def test_kvcheck_command(tmp_path, tiny_model):
    job = gate_job(tmp_path, tiny_model[0], {}, dtype="int8")
    result = CliRunner().invoke(main, ["kvcheck", job, "--sample", "3"])
    assert result.exit_code == 0, result.output
    assert "kv int8 vs auto:" in result.output and '"requests": 3' in result.output
    bad = CliRunner().invoke(main, ["kvcheck", job, "--set", "engine.kv_cache_dtype=float16"])
    assert bad.exit_code != 0 and "kvcheck compares an 8-bit KV dtype" in bad.output


def test_gate_floor_on_the_prompts_log_likelihood(tmp_path, tiny_model):
    job = gate_job(tmp_path, tiny_model[0], {"sample": 4, "min_identical": 0.0, "max_loglik_drop": 0.05},
                   dtype="int8")
    result = Job.from_yaml(job).run(progress="log")
    gate = json.load(open(os.path.join(result.output_dir, "summary.json")))["kv_quality_gate"]
    drop = gate["report"]["loglik_drop"]
    assert gate["passed"] and abs(drop) < 0.05
    assert gate["reason"].endswith(f"; prompt log-likelihood drop {drop:+.4f} per token <= max_loglik_drop 0.05")


def test_gate_verdict_needs_both_floors():
    from types import SimpleNamespace
    from batchrun.job.kv_gate import verdict
    from batchrun.kvcheck import KVCheckReport
    report = KVCheckReport("int8", "auto", 8, 0.5, 3.0, 0.01, -0.01, prompt_loglik=-3.3,
                           reference_prompt_loglik=-3.2, mean_abs_prompt_logprob_diff=0.1)
    gate = SimpleNamespace(min_identical=0.25, max_loglik_drop=0.05)
    passed, reason = verdict(report, gate)
    assert not passed and reason.endswith("drop +0.1000 per token > max_loglik_drop 0.05")
    assert verdict(report, SimpleNamespace(min_identical=0.25, max_loglik_drop=0.2))[0]
    assert verdict(report, SimpleNamespace(min_identical=0.25, max_loglik_drop=None)) == (
        True, "50.0% identical greedy outputs on 8 sample prompts >= min_identical 25.0%")
    assert not verdict(report, SimpleNamespace(min_identical=0.75, max_loglik_drop=0.2))[0]
