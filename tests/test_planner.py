"""Planner: catalog, cost model, simulation over the real scheduler, plan table, bad input, calibration."""
from __future__ import annotations

import json
from datetime import datetime
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from batchrun.deadline import parse_deadline, seconds_until
from batchrun.engine import kv_cache
from batchrun.job.spec import JobSpec
from batchrun.planner import plan as planner
from batchrun.planner.api import deadline_seconds
from batchrun.planner.calibrate import calibrate, run_calibration
from batchrun.planner.workload import Workload, load_workload, read_model_config
from batchrun.stepmodel import catalog
from batchrun.stepmodel.costmodel import ModelSpec, RooflineModel, StepShape
from batchrun.stepmodel.linear_fit import ContextPrior, fit_linear
from batchrun.stepmodel.simulate import WorkItem, simulate, timeline
from jobkit import cli, plan, write_job, write_prompts

LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, num_attention_heads=64, num_hidden_layers=80, intermediate_size=28672)


def work(n=60, prompt=200, out=50, seqs=64, **kw) -> Workload:
    items = [WorkItem(prompt + (i * 37) % prompt, out + (i * 13) % out) for i in range(n)]
    return Workload(items, [()] * n, 16, seqs, 2048, False, **kw)


def test_catalog_has_the_gpus_with_sources_and_user_overrides(tmp_path):
    cat = catalog.load_catalog()
    for name in ("H100-80GB", "H200-141GB", "A100-40GB", "A100-80GB", "L40S", "L4", "A10G"):
        gpu = cat[name]
        assert gpu.memory_gb > 0 and gpu.bandwidth_gbs > 0 and gpu.fp16_tflops > 0 and gpu.price_per_hour > 0
        assert "datasheet" in gpu.source and "price" in gpu.source
    user = tmp_path / "gpus.yaml"
    user.write_text("L4: {price_per_hour: 0.5}\nMI300X: {memory_gb: 192, bandwidth_gbs: 5300, fp16_tflops: 1307, "
                    "fp8_tflops: 2615, price_per_hour: 4.0, source: AMD MI300X datasheet}\n")
    cat = catalog.load_catalog(str(user))
    assert cat["L4"].price_per_hour == 0.5 and cat["L4"].memory_gb == 24 and cat["MI300X"].memory_gb == 192
    assert catalog.lookup(cat, "h100").name == "H100-80GB"
    assert catalog.select(cat, ["L40S"], {"l40s": 2.0})[0].price_per_hour == 2.0
    with pytest.raises(ValueError, match="--gpu: unknown GPU 'B300'"):
        catalog.lookup(cat, "B300")
    with pytest.raises(ValueError, match="--gpu: unknown GPU 'A100'"):   # ambiguous prefix
        catalog.lookup(cat, "A100")
    with pytest.raises(ValueError, match="--price"):
        catalog.parse_prices(["L4=free"])
    user.write_text("X1: {memory_gb: -1, bandwidth_gbs: 1, fp16_tflops: 1, price_per_hour: 1, source: s}\n")
    with pytest.raises(ValueError, match="X1.memory_gb: must be a positive number"):
        catalog.load_catalog(str(user))


def test_model_spec_counts_parameters_from_the_config():
    assert abs(ModelSpec.from_config(LLAMA3_8B).num_params / 1e9 - 8.03) < 0.01
    assert abs(ModelSpec.from_config(LLAMA3_70B).num_params / 1e9 - 70.55) < 0.05
    tied = ModelSpec.from_config(dict(LLAMA3_8B, tie_word_embeddings=True))
    assert tied.num_params == ModelSpec.from_config(LLAMA3_8B).num_params - 128256 * 4096
    with pytest.raises(ValueError, match="model: the config"):
        ModelSpec.from_config({"hidden_size": 64})


def test_kv_bytes_per_token_include_scales_and_match_the_engine():
    m = ModelSpec.from_config(LLAMA3_8B)
    assert planner.kv_bytes_per_token(m, "float16") == 2 * 32 * 8 * 128 * 2
    assert planner.kv_bytes_per_token(m, "int8") == 2 * 32 * 8 * (128 + 4)
    assert planner.kv_bytes_per_token(m, "fp8") == kv_cache.bytes_per_token(32, 8, 128, torch.float8_e4m3fn)


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound():
    cost = RooflineModel(ModelSpec.from_config(LLAMA3_8B), catalog.load_catalog()["H100-80GB"], 131072)
    mem, compute = cost.parts(StepShape(1, 1, 1000, 1000))
    assert mem > 10 * compute and 0.004 < cost.decode_step(1, 1000) < 0.01      # ~16 GB / 3.35 TB/s
    mem, compute = cost.parts(StepShape(4096, 1, 4096, 4096 * 4097 // 2))
    assert compute > mem
    assert cost.decode_step(64, 2000) > cost.decode_step(64, 500) > cost.decode_step(1, 500)


def test_simulation_drives_the_real_scheduler_and_produces_every_output_token():
    items = work().items
    roomy = simulate(items, 10_000, 16, 64, 2048)
    assert sum(roomy.out_tokens) == sum(i.output_tokens for i in items) and sum(roomy.finished) == len(items)
    assert roomy.preemptions == 0 and max(roomy.running) <= 64
    tight = simulate(items, 60, 16, 64, 2048)        # 960 tokens: a few requests at a time, with preemption
    assert sum(tight.out_tokens) == sum(i.output_tokens for i in items)
    assert max(tight.running) < 10 and tight.steps > roomy.steps
    line = timeline(roomy, lambda s: 0.001 + 1e-6 * s.tokens)
    assert line.makespan_s == pytest.approx(sum(0.001 + 1e-6 * s.tokens for s in roomy.shapes))
    assert 0 < line.drain_s <= line.makespan_s and line.progress()[-1][1] == 1.0


def test_plan_table_deadline_cost_and_recommendation():
    model = ModelSpec.from_config(LLAMA3_8B)
    p = planner.Planner(model, work(n=200, prompt=1000, out=300), deadline_s=18.0)
    report = p.plan(catalog.select(catalog.load_catalog(), ["H100", "L4", "A10G"]))
    rows = {(r["gpu"], r["kv_dtype"]): r for r in report["rows"]}
    h100, h100_int8 = rows[("H100-80GB", "float16")], rows[("H100-80GB", "int8")]
    assert h100_int8["blocks"] == pytest.approx(h100["blocks"] * 256 / 132, rel=1e-3)   # int8 + fp32 scales
    assert h100["weights_gib"] == pytest.approx(model.num_params * 2 / 2**30)
    assert h100["max_concurrency_max_context"] == h100["kv_tokens"] // 8192
    for r in (h100, h100_int8):
        assert r["fits"] and r["meets_deadline"] and r["makespan_s"] <= 18.0 and r["gpus"] >= 1
        assert r["cost_usd"] == pytest.approx(r["gpus"] * r["makespan_s"] / 3600 * r["price_per_hour"])
        assert r["drain_s"] <= r["makespan_1gpu_s"]
    assert h100["gpus"] > 1 and h100["makespan_1gpu_s"] > 18.0, h100
    # 15 GiB of weights leave an L4 (24 GB at 0.9) about 5 GiB of KV: it fits, but no count of single-L4 replicas
    # meets 18 s; replicas of tensor-parallel L4s do
    l4_alone = p.row_at(catalog.load_catalog()["L4"], "float16", None, 1)
    assert l4_alone["kv_budget_gib"] == pytest.approx(24e9 * 0.9 / 2**30 - l4_alone["weights_gib"]
                                                      - l4_alone["activations_gib"])
    assert l4_alone["fits"] and l4_alone["kv_tokens"] >= 8192
    assert not l4_alone["meets_deadline"] and l4_alone["gpus"] is None and "deadline" in l4_alone["reason"]
    l4 = rows[("L4", "float16")]
    assert l4["tp"] > 1 and l4["meets_deadline"] and l4["gpus"] == l4["replicas"] * l4["tp"]
    rec = report["recommendation"]
    assert rec and (rec["gpu"], rec["kv_dtype"]) in rows and "cheapest" in rec["reason"]
    best = rows[(rec["gpu"], rec["kv_dtype"])]
    assert all(best["cost_usd"] <= r["cost_usd"] for r in report["rows"] if r.get("meets_deadline"))
    assert "recommendation" in planner.format_table(report)


def test_types_that_do_not_fit_are_reported_per_type():
    big = ModelSpec.from_config(dict(LLAMA3_70B, num_hidden_layers=800))
    report = planner.Planner(big, work()).plan(catalog.select(catalog.load_catalog(), ["L4", "H200"]))
    # 1.4 TB of fp16 weights: more than 90% of even 8 H200s (the most tensor parallelism the plan tries)
    assert all(not r["fits"] and "weights" in r["reason"] for r in report["rows"])
    assert report["recommendation"] is None and "none of the GPU types" in planner.format_table(report)
    long = work(n=3, prompt=4_000_000, out=10)   # 264 GB of KV even in fp8: more than 8 A10Gs hold
    report = planner.Planner(ModelSpec.from_config(dict(LLAMA3_8B, max_position_embeddings=5_000_000)), long).plan(
        catalog.select(catalog.load_catalog(), ["A10G"]))
    a10g = [r for r in report["rows"] if r["gpu"] == "A10G"]
    assert all(not r["fits"] and "longest request" in r["reason"] for r in a10g)
    assert "does not fit" in planner.format_table(report)


def test_one_deadline_grammar_for_the_job_file_and_the_planner():
    now = datetime(2030, 1, 31, 22, 0)
    assert seconds_until("6h", now) == 6 * 3600 and seconds_until("1h30m", now) == 5400
    assert seconds_until("07:00", now) == 9 * 3600                            # the next 07:00
    assert seconds_until("2030-02-01T06:00", now) == 8 * 3600
    assert parse_deadline("90m", now) == datetime(2030, 1, 31, 23, 30)
    for bad, msg in (("soon", "cannot read 'soon' as a deadline"), ("2001-01-01T00:00", "in the past"),
                     ("0h", "positive")):
        with pytest.raises(ValueError, match=msg):
            seconds_until(bad, now)


def test_plan_uses_the_job_files_deadline_unless_given(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model[0], deadline="2h")
    spec = JobSpec.from_yaml(job)
    assert abs(deadline_seconds(spec, None) - 7200) < 60 and deadline_seconds(spec, "30m") == pytest.approx(1800, 1)
    assert deadline_seconds(JobSpec.from_yaml(write_job(tmp_path, tiny_model[0], name="free")), None) is None
    with pytest.raises(ValueError, match=r"deadline \(line \d+\): '2001-01-01T00:00' is in the past"):
        deadline_seconds(JobSpec.from_yaml(write_job(tmp_path, tiny_model[0], name="old",
                                                     deadline="2001-01-01T00:00")), None)


def test_fit_recovers_a_linear_step_time_and_reports_held_out_error():
    shapes = [StepShape(t, 8, c, c) for t, c in ((10 + (i * 37) % 400, 500 + (i * 7919) % 20000) for i in range(60))]
    times = [0.002 + 1e-5 * s.tokens + 2e-7 * s.kv_tokens for s in shapes]
    model = fit_linear(shapes, times)
    assert model.a == pytest.approx(0.002, rel=1e-3) and model.b == pytest.approx(1e-5, rel=1e-3)
    assert model.heldout_error < 0.1
    with pytest.raises(ValueError, match="calibration"):
        fit_linear(shapes[:3], times[:3])


def test_fit_takes_the_context_cost_from_the_prior_only_where_the_steps_cannot_tell_it():
    rng = np.random.default_rng(0)
    a, b, c = 0.09, 2.7e-3, 7.7e-6            # c / a = 8.6e-5: fp32 SmolLM2's KV bytes per token / weight bytes

    def noisy(shapes):
        return [(a + b * s.tokens + c * s.kv_tokens) * rng.uniform(0.95, 1.05) for s in shapes]

    # a full KV pool: every step's context sum within 3 % of 23k tokens
    full = [StepShape(n, n, int(23000 * rng.uniform(0.97, 1.0)), 0) for n in rng.integers(16, 33, 200)]
    times = noisy(full)
    free = fit_linear(full, times, holdout_every=0)
    tied = fit_linear(full, times, holdout_every=0, prior=ContextPrior(c / a))
    decode_tail = StepShape(32, 32, 3000, 0)   # what comes after: short contexts
    truth = a + b * 32 + c * 3000
    assert tied.step_time(decode_tail) == pytest.approx(truth, rel=0.1)
    assert free.step_time(decode_tail) > 1.3 * truth   # c lost in a: the tail priced for a full pool
    # contexts that vary: the data decide, a prior 3x off moves the fit by little
    varied = [StepShape(n, n, int(k), 0) for n, k in zip(rng.integers(16, 33, 200), rng.uniform(1000, 23000, 200))]
    times = noisy(varied)
    for ratio in (c / a / 3, 3 * c / a):
        wrong = fit_linear(varied, times, holdout_every=0, prior=ContextPrior(ratio))
        for shape in (decode_tail, StepShape(32, 32, 23000, 0), StepShape(16, 16, 12000, 0)):
            assert wrong.step_time(shape) == pytest.approx(a + b * shape.tokens + c * shape.kv_tokens, rel=0.05)


def test_fit_never_gives_a_negative_coefficient():
    shapes = [StepShape(t, 1, k, 0) for t, k in ((10 + 7 * i, 100 + 50 * i) for i in range(20))]
    model = fit_linear(shapes, [max(0.0, -0.05 + 0.01 * s.tokens) for s in shapes], holdout_every=0)
    assert min(model.a, model.b, model.c) >= 0


def test_plan_command_on_a_job(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", n=20)
    job = write_job(tmp_path, tiny_model[0])
    out = cli("plan", job, "--gpu", "L4", "--gpu", "H100", "--deadline", "1h", "--json")   # the installed entry once
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["job"]["requests"] == 20 and len(report["rows"]) == 6 and report["recommendation"]
    assert report["model"]["layers"] == 2
    table = plan(job, "--gpu", "A10G", "--price", "A10G=0.5")
    assert table.returncode == 0 and "A10G" in table.stdout and "recommendation" in table.stdout
    bad = plan(job, "--gpu", "Z80")
    assert bad.returncode == 2 and "--gpu: unknown GPU 'Z80'" in bad.stderr
    bad = plan(job, "--deadline", "yesterday")
    assert bad.returncode == 2 and "--deadline" in bad.stderr
    bad = plan(job, "--model-config", str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and "--model-config: cannot read the model config" in bad.stderr


def test_calibration_predicts_the_job_on_a_synthetic_clock(tmp_path, tiny_model):
    """Deterministic: each engine step 'takes' 2 ms + 10 us per token. Pilot, fit and simulation must predict the
    whole job's stepping time on that clock, as the same engine then spends it on the whole job."""
    from batchrun import LLM
    # rows of 6-16 tokens finish at different steps: the pilot's steps hold from 1 to 8 sequences, which tells a
    # step's fixed cost from a sequence's (a fitted decode step has as many tokens as sequences)
    write_prompts(tmp_path / "in.parquet", n=60, max_tokens=[6 + (i * 7) % 11 for i in range(60)])
    spec = JobSpec.from_yaml(write_job(tmp_path, tiny_model[0], input={"max_tokens_column": "max_tokens"},
                                       sampling={"max_tokens": 12, "ignore_eos": True}, engine={"max_num_seqs": 8}))
    work = load_workload(spec, read_model_config(spec.model))

    def clocked_engine():   # the first observer sets the step's time; the ones after it (calibration's) read it
        engine = LLM(model=spec.model, **spec.engine_options).engine
        engine.observe(lambda stats: setattr(stats, "step_time", 0.002 + 1e-5 * stats.shape.tokens))
        return engine

    cal = run_calibration(spec, work, 0.2, SimpleNamespace(engine=clocked_engine()))
    assert (cal.model.a, cal.model.b, cal.model.c, cal.model.scale) == pytest.approx((0.002, 1e-5, 0, 1), abs=1e-9)
    engine = clocked_engine()   # as a submit starts: nothing of the pilot's prompts in its prefix cache
    for item, key in zip(work.items, work.keys):
        engine.add_request(list(item.prompt), spec.sampling_params(max_tokens=item.output_tokens), order_key=key)
    spent = 0.0
    while engine.has_unfinished():
        engine.step()
        spent += engine.stats.step_time
    assert cal.report["predicted"]["output_tokens"] == sum(6 + (i * 7) % 11 for i in range(60))
    assert cal.report["predicted"]["makespan_s"] == pytest.approx(spent, rel=0.01)


@pytest.mark.slow
def test_calibration_predicts_the_measured_wall_clock(tmp_path, tiny_model):
    """Pilot on 20% of the rows, predict the whole job's stepping time, run the job, compare (generous bound:
    the tiny model's steps are a few ms of Python on a shared CPU)."""
    from batchrun.job import Job
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # on a shared 2-core machine, two spinning threads turn others' load into stalls
    try:
        _calibrate_and_run(tmp_path, tiny_model, Job)
    finally:
        torch.set_num_threads(threads)


def _calibrate_and_run(tmp_path, tiny_model, Job):
    write_prompts(tmp_path / "in.parquet", n=60)
    job = write_job(tmp_path, tiny_model[0], sampling={"max_tokens": 12, "ignore_eos": True},
                    engine={"max_num_seqs": 8})
    spec = JobSpec.from_yaml(job)
    model = read_model_config(spec.model)
    report = calibrate(spec, load_workload(spec, model), 0.2)
    assert report["pilot"]["requests"] == 12 and report["fit"]["steps"] >= 10
    predicted = report["predicted"]["makespan_s"]
    result = Job.from_yaml(job).run(progress="log")
    measured = result.summary["wall_s"]
    print(f"calibration: predicted {predicted:.3f}s, measured {measured:.3f}s, fit {report['fit']}")
    assert report["predicted"]["output_tokens"] == 60 * 12
    assert 0.4 < predicted / measured < 2.5, (predicted, measured)
