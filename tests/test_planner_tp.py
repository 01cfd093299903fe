"""The planner with tensor parallelism: weights and KV split per GPU, all-reduce time from the catalog's
interconnect (NVLink vs PCIe) in the step cost, the tensor-parallel size per row and in the recommendation's
executor stanza and engine settings."""
import dataclasses

import pytest

from batchrun.engine.step_stats import StepShape
from batchrun.planner import plan as planner
from batchrun.stepmodel import catalog
from batchrun.stepmodel.costmodel import ModelSpec, RooflineModel, kv_share
from test_planner import LLAMA3_8B, LLAMA3_70B, work

DECODE = StepShape(64, 64, 64 * 500, 64 * 500)


def test_step_cost_splits_work_and_adds_the_all_reduces():
    m, h100 = ModelSpec.from_config(LLAMA3_70B), catalog.load_catalog()["H100-80GB"]
    one, four = (RooflineModel(m, h100, 327680, tp=tp) for tp in (1, 4))
    assert four.parts(DECODE)[1] == pytest.approx(one.parts(DECODE)[1] / 4)
    assert four.parts(DECODE)[0] == pytest.approx(one.parts(DECODE)[0] / 4)   # 8 KV heads: 2 per GPU
    assert one.allreduce_time(DECODE) == 0
    # 161 all-reduces of 64 x 8192 x 2 bytes, each GPU moving 2 x 3/4 of them, over 450 GB/s x 0.7, + latencies
    ring = 161 * 1.5 * 64 * 8192 * 2 + 0.75 * 64 * 128256 * 4
    assert four.allreduce_time(DECODE) == pytest.approx(ring / (450e9 * 0.7) + 162 * 8e-6)
    assert four.step_time(DECODE) == pytest.approx(four.overhead_s + max(four.parts(DECODE))
                                                   + four.allreduce_time(DECODE))
    pcie = dataclasses.replace(h100, interconnect_gbs=None)   # 25 GB/s: 18x slower than NVLink's 450
    assert RooflineModel(m, pcie, 327680, tp=4).allreduce_time(DECODE) > 5 * four.allreduce_time(DECODE)
    assert kv_share(8, 16) == 1 / 8 and kv_share(8, 2) == 1 / 2   # one replicated head beyond 8 ranks


def test_70b_gets_tensor_parallel_replicas_and_the_stanza_carries_them():
    report = planner.Planner(ModelSpec.from_config(LLAMA3_70B), work(), deadline_s=3600).plan(
        catalog.select(catalog.load_catalog(), ["H100", "H200"]), ["float16"])
    rows = {r["gpu"]: r for r in report["rows"]}
    h100, h200 = rows["H100-80GB"], rows["H200-141GB"]
    assert h200["tp"] >= 2 and h100["tp"] >= 2 and h100["fits"] and h200["fits"]   # 141 GB of weights
    for r in (h100, h200):
        assert r["weights_gib"] == pytest.approx(ModelSpec.from_config(LLAMA3_70B).weight_bytes / r["tp"] / 2**30)
        assert r["gpus"] == r["replicas"] * r["tp"]
        assert r["cost_usd"] == pytest.approx(r["gpus"] * r["makespan_s"] / 3600 * r["price_per_hour"])
    rec = report["recommendation"]
    best = rows[rec["gpu"]]
    assert rec["tensor_parallel_size"] == best["tp"]
    assert rec["executor"]["gpus_per_replica"] == best["tp"] and rec["executor"]["replicas"] == best["replicas"]
    assert f"tensor_parallel_size: {best['tp']}" in planner.format_table(report)


def test_a_model_that_fits_one_gpu_stays_on_one():
    report = planner.Planner(ModelSpec.from_config(LLAMA3_8B), work()).plan(
        catalog.select(catalog.load_catalog(), ["H100"]), ["float16"])
    (row,) = report["rows"]
    assert row["tp"] == 1 and report["recommendation"]["executor"]["gpus_per_replica"] == 1
    assert "tensor_parallel_size" not in planner.format_table(report)
