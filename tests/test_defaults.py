"""One source of defaults: every entry point ends with the same EngineConfig for the same input, and an unset
kv_cache_memory on CUDA means a pool sized from the profiled step (CUDA memory queries faked here)."""
import dataclasses
import logging

import pytest
import torch
from click.testing import CliRunner

import batchrun.engine.llm as llm_module
from batchrun import LLM, Job
from batchrun.cli import main
from batchrun.config import EngineConfig
from batchrun.engine import kv_sizing
from batchrun.job.spec import JobSpec
from jobkit import write_job, write_prompts


class Built(Exception):
    """Raised by the stand-in Engine with the config it was given: no model is loaded."""


@pytest.fixture
def configs(monkeypatch):
    seen = []

    def record(config, admission_key=None):
        seen.append(dataclasses.asdict(config))
        raise Built

    monkeypatch.setattr(llm_module, "Engine", record)
    return seen


def test_every_entry_point_builds_the_same_engine_config(tmp_path, tiny_model, configs):
    model = tiny_model[0]
    write_prompts(tmp_path / "in.parquet", 4)
    with pytest.raises(Built):
        LLM(model=model)
    with pytest.raises(Built):
        Job(JobSpec({"model": model, "input": {"path": str(tmp_path / "in.parquet")},
                     "output": {"path": str(tmp_path / "out")}})).run(progress="log")
    generated = CliRunner().invoke(main, ["generate", str(tmp_path / "in.parquet"), "--model", model,
                                          "--output", str(tmp_path / "gen"), "--progress", "log"])
    assert isinstance(generated.exception, Built), generated.output
    served = CliRunner().invoke(main, ["serve", "--model", model])
    assert isinstance(served.exception, Built), served.output
    assert len(configs) == 4 and all(c == configs[0] for c in configs), configs
    assert configs[0]["kv_cache_memory"] is None and configs[0]["max_num_seqs"] == EngineConfig.max_num_seqs


def fake_cuda(monkeypatch, total=80 * 2**30, peak=3 * 2**30):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: peak)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - peak, total))
    return calls


def test_a_job_without_kv_cache_memory_sizes_its_pool_from_the_cuda_profile(tmp_path, tiny_model, monkeypatch,
                                                                            caplog):
    fake_cuda(monkeypatch)
    spec = JobSpec.from_yaml(write_job(tmp_path, tiny_model[0], engine={"kv_cache_memory": None}))
    assert "kv_cache_memory" not in spec.engine_options
    config = EngineConfig(model=spec.model, **spec.engine_options)
    profiled = []
    with caplog.at_level(logging.INFO, logger="batchrun"):
        budget, field = kv_sizing.total_kv_budget(config, torch.device("cuda"), lambda: profiled.append(1))
    assert profiled == [1] and field == "gpu_memory_utilization"
    assert budget == int(80 * 2**30 * 0.9 - 3 * 2**30)   # total x utilisation - peak; no other process
    assert "KV budget 69.00 GiB at utilisation 0.90" in caplog.text
    explicit = EngineConfig(model=spec.model, kv_cache_memory="1GiB")
    assert kv_sizing.total_kv_budget(explicit, torch.device("cuda"), lambda: pytest.fail("profiled")) == \
        (2**30, "kv_cache_memory")


def test_validate_reports_the_pool_a_cuda_run_would_profile(tmp_path, tiny_model, monkeypatch):
    fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: type("Props", (), {"total_memory": 80 * 2**30, "name": "Fake GPU"}))
    write_prompts(tmp_path / "in.parquet", 4)
    report = Job.from_yaml(write_job(tmp_path, tiny_model[0], engine={"kv_cache_memory": None})).validate()
    weights = report["kv_cache_sizing"]["weights_bytes"]
    assert weights > 0 and report["kv_cache_sizing"]["how"].startswith("profiled at start-up")
    assert report["kv_cache_memory_mib"] == pytest.approx((80 * 2**30 * 0.9 - weights) / 2**20, abs=1)
    cpu = Job.from_yaml(write_job(tmp_path, tiny_model[0], name="cpu",
                                  engine={"device": "cpu", "kv_cache_memory": None})).validate()
    assert cpu["kv_cache_memory_mib"] == 2048 and cpu["kv_cache_sizing"]["how"] == "CPU default"
