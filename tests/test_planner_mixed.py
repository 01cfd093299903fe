"""Mixed-SLA planning (a shared pool with lanes vs a latency pool + a throughput pool) and --plot."""
from __future__ import annotations

import json

import numpy as np
import pytest

from batchrun.engine.scheduler import Scheduler
from batchrun.planner import mixed, plan as planner
from batchrun.stepmodel import catalog
from batchrun.stepmodel.costmodel import ModelSpec
from jobkit import plan, write_job, write_prompts
from test_planner import LLAMA3_8B, work

H100 = catalog.load_catalog()["H100-80GB"]
TRAFFIC = dict(prompt_tokens=512, output_tokens=128, ttft_p95_s=0.5, tpot_p95_s=0.05)


def planner_for(deadline=120.0, **kw) -> planner.Planner:
    return planner.Planner(ModelSpec.from_config(LLAMA3_8B), work(n=200, prompt=1000, out=300, seqs=128, **kw),
                           deadline_s=deadline)


def latency_served(p: planner.Planner, rate: float, arrivals: int = 300) -> mixed.Served:
    w, bpt = p.work, p.kv_bytes_per_token("float16")
    lane = mixed.make_lane("interactive", 20_000, 16, w.max_num_seqs, w.max_num_batched_tokens, False)
    traffic = mixed.Traffic(rate, **TRAFFIC)
    return mixed.serve(Scheduler([lane], w.max_num_seqs, w.max_num_batched_tokens), p.cost_model(H100, bpt),
                       {"interactive": bpt}, traffic, rate, arrivals=arrivals)


def test_served_latency_grows_with_load_and_matches_an_idle_request():
    p = planner_for()
    cost = p.cost_model(H100, p.kv_bytes_per_token("float16"))
    light, heavy = latency_served(p, 0.2), latency_served(p, 40.0)
    assert len(light.ttft) == len(light.tpot) == 300
    # nearly alone on the GPU: first token after the prompt's one prefill step (plus, at worst, the end of another
    # request's decode step), then one decode step per token
    prefill, decode = cost.prefill_step(512), cost.decode_step(2, 640)
    assert float(np.median(light.ttft)) == pytest.approx(prefill, rel=0.1)
    assert prefill <= light.ttft_p95 <= prefill + 1.1 * decode
    assert light.tpot_p95 == pytest.approx(cost.decode_step(1, 600), rel=0.25)
    assert heavy.ttft_p95 > light.ttft_p95 and heavy.tpot_p95 > 1.5 * light.tpot_p95


def test_smallest_finds_the_first_feasible_count():
    seen = []

    def feasible(n):
        seen.append(n)
        return n >= 37
    assert mixed.smallest(feasible, 1, 4096) == 37 and len(seen) < 16
    assert mixed.smallest(lambda n: False, 1, 64) is None
    assert mixed.smallest(lambda n: True, 5, 64) == 5


def test_mixed_plan_sizes_both_layouts_and_recommends_the_cheaper():
    p = planner_for()
    report = p.plan([H100], ("float16", "int8"), mixed.Traffic(4.0, **TRAFFIC))
    rows = {r["layout"]: r for r in report["mixed"]["rows"]}
    shared, two = rows["shared"], rows["two pools"]
    batch = next(r for r in report["rows"] if r["kv_dtype"] == "int8")
    for r in (shared, two):
        assert r["gpus"] and r["ttft_p95_s"] <= 0.5 and r["tpot_p95_s"] <= 0.05 and r["batch_makespan_s"] <= 120
        assert r["cost_usd"] == pytest.approx(r["gpus"] * 120 / 3600 * H100.price_per_hour)
    assert two["batch_gpus"] == batch["gpus"] and two["latency_gpus"] >= 1
    assert two["gpus"] == two["latency_gpus"] + two["batch_gpus"]
    assert shared["gpus"] >= batch["gpus"] and shared["max_num_batched_tokens"] in (2048, 1024, 512)
    rec = report["mixed"]["recommendation"]
    best = min(report["mixed"]["rows"], key=lambda r: r["cost_usd"])
    assert rec["layout"] == best["layout"] and rec["gpus"] == best["gpus"]
    text = planner.format_table(report)
    assert "mixed SLA" in text and "two pools" in text and "mixed recommendation" in text


def test_more_traffic_needs_more_latency_gpus_and_impossible_targets_say_why():
    p = planner_for()
    light = p.plan([H100], ("int8",), mixed.Traffic(2.0, **TRAFFIC))["mixed"]["rows"]
    heavy = p.plan([H100], ("int8",), mixed.Traffic(60.0, **TRAFFIC))["mixed"]["rows"]
    lat = lambda rows: next(r for r in rows if r["layout"] == "two pools")["latency_gpus"]
    assert lat(heavy) > lat(light)
    tight = p.plan([H100], ("int8",), mixed.Traffic(1.0, 512, 128, ttft_p95_s=0.001, tpot_p95_s=0.05))
    assert all(r["gpus"] is None and "first token" in r["reason"] for r in tight["mixed"]["rows"])
    assert tight["mixed"]["recommendation"] is None
    with pytest.raises(ValueError, match="--deadline"):
        planner_for(deadline=None).plan([H100], ("int8",), mixed.Traffic(1.0, **TRAFFIC))


def test_traffic_and_latency_parsing():
    assert mixed.parse_latency("500ms", "--ttft-p95") == 0.5
    assert mixed.parse_latency("2s", "--ttft-p95") == 2.0 and mixed.parse_latency("0.05", "--tpot-p95") == 0.05
    for bad in ("fast", "0ms", "-1s"):
        with pytest.raises(ValueError, match="--ttft-p95"):
            mixed.parse_latency(bad, "--ttft-p95")
    with pytest.raises(ValueError, match="--interactive-rate"):
        mixed.Traffic(0, **TRAFFIC)


def test_plan_command_mixed_json_and_plot(tmp_path, tiny_model):
    pytest.importorskip("matplotlib")
    write_prompts(tmp_path / "in.parquet", n=20)
    job = write_job(tmp_path, tiny_model[0])
    png = tmp_path / "plan.png"
    out = plan(job, "--gpu", "L4", "--deadline", "10m", "--interactive-rate", "2", "--ttft-p95", "500ms",
               "--tpot-p95", "50ms", "--plot", str(png), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {r["layout"] for r in report["mixed"]["rows"]} == {"shared", "two pools"}
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    bad = plan(job, "--interactive-rate", "2")
    assert bad.returncode == 2 and "--deadline" in bad.stderr
    bad = plan(job, "--deadline", "1h", "--interactive-rate", "2", "--tpot-p95", "soon")
    assert bad.returncode == 2 and "--tpot-p95" in bad.stderr
