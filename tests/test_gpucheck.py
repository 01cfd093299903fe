"""The one-call GPU check, run dry on the CPU (every section on the same code path at toy sizes), and its parts."""
import json
import types

import pytest
import torch

from batchrun import gpucheck
from batchrun.gpucheck import cli, identity, interactive, summary, workload


def test_gpucheck_dry_run_runs_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    result = gpucheck.main(["--dry-run", "--models", str(tmp_path / "models"), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    sections = result["sections"]
    assert list(sections) == list(cli.SECTIONS)
    assert {n: s.get("error") or s.get("skipped") for n, s in sections.items() if "error" in s or "skipped" in s} == {}
    sizes = cli.DRY
    assert [r["kv_dtype"] for r in sections["kernels"]["decode"]] == ["float16", "int8", "fp8"]

    runs = {r["kv_cache_dtype"]: r for r in sections["identity"]["device_runs"]}
    assert list(runs) == list(identity.KV_DTYPES)
    # the dry run's "device" is the CPU: float32 KV is the reference's own computation
    assert runs["float32"]["identical"] == 1.0 and runs["float32"]["max_logprob_diff"] == 0.0
    assert all(0 <= r["identical"] <= r["mean_prefix_share"] <= 1 for r in runs.values())

    for name, kvs in (("throughput", ["float16", "int8", "fp8"]), ("throughput_smollm2", ["float16", "int8"])):
        assert [r["kv_cache_dtype"] for r in sections[name]["runs"]] == kvs
        for run in sections[name]["runs"]:
            assert run["output_tokens"] == sizes.requests * sizes.max_tokens and run["preemptions"] == 0
            assert run["pool"]["blocks"] > 0 and run["pool"]["max_concurrency_at_max_len"] >= sizes.requests
            split = run["step_split"]
            assert split["forward"] > 0 and split["sampler"] > 0 and split["scheduler"] > 0
            assert abs(sum(split[k] for k in ("forward", "sampler", "scheduler", "rest")) - 1) < 1e-5
        int8 = sections[name]["runs"][1]
        assert int8["capacity_vs_float16"] > 1.5 and int8["pool"]["tokens"] > sections[name]["runs"][0]["pool"]["tokens"]

    assert sections["peer"]["method"] == "generate_batch"
    assert sections["peer"]["output_tokens"] == sizes.requests * sizes.max_tokens

    inter = sections["interactive"]
    assert inter["interactive_requests"] == sizes.interactive_requests
    assert inter["min_batch_running_at_submit"] == sizes.requests   # every TTFT was taken with the batch running
    assert 0 < inter["ttft_p50_s"] <= inter["ttft_p95_s"] <= inter["ttft_max_s"]

    text = summary.summarize(result)
    assert "DRY RUN" in text and "ERROR" not in text and "transformers" in text and "TTFT" in text


def test_deadline_skips_sections_and_unknown_section_is_refused(tmp_path):
    result = gpucheck.main(["--dry-run", "--models", str(tmp_path), "--sections", "identity,peer",
                            "--deadline-s", "0"])
    assert list(result["sections"]) == ["identity", "peer"]
    assert all(s["skipped"].startswith("deadline") for s in result["sections"].values())
    with pytest.raises(SystemExit, match="unknown section.*allowed: kernels"):
        gpucheck.main(["--dry-run", "--sections", "kernel"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda():
    with pytest.raises(SystemExit, match="no CUDA device.*--dry-run"):
        gpucheck.main([])


def test_a_failing_section_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (planted)")
    monkeypatch.setattr(cli.peer, "transformers_peer", broken)
    result = gpucheck.main(["--dry-run", "--models", str(tmp_path), "--sections", "peer,interactive"])
    assert result["sections"]["peer"]["error"] == "RuntimeError: out of memory (planted)"
    assert "ttft_p95_s" in result["sections"]["interactive"]
    assert "peer: ERROR RuntimeError: out of memory (planted)" in summary.summarize(result)


def test_random_prompts():
    prompts = workload.random_prompts(50, 100, 1000, seed=3)
    assert all(75 <= len(p) <= 125 for p in prompts) and all(3 <= t < 1000 for p in prompts for t in p)
    assert len({tuple(p[:16]) for p in prompts}) == 50                       # no shared first block
    assert prompts == workload.random_prompts(50, 100, 1000, seed=3)        # seeded
    assert workload.max_len_for([[1] * 20, [1] * 33], 10) == 48
    with pytest.raises(ValueError, match="count and mean_tokens must be positive"):
        workload.random_prompts(0, 100, 1000)


def _out(tokens, logprobs=None):
    return types.SimpleNamespace(token_ids=tokens, logprobs=logprobs)


def test_compare_counts_identical_requests_and_the_prefix_before_the_first_difference():
    ref = [_out([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), _out([5, 6, 7, 8], [-1.0] * 4)]
    got = [_out([1, 2, 3, 4], [-0.1, -0.25, -0.3, -0.4]), _out([5, 6, 9, 8], [-1.0, -1.0, -5.0, -1.0])]
    result = identity.compare(ref, got)
    # the second request's difference at its third token: its logprobs count only before it
    assert result == {"identical": 0.5, "mean_prefix_share": 0.75, "max_logprob_diff": pytest.approx(0.05)}
    with pytest.raises(ValueError, match="2 reference outputs against 1"):
        identity.compare(ref, got[:1])


def test_percentile():
    values = [0.5, 0.1, 0.3, 0.2, 0.4]
    assert interactive.percentile(values, 50) == 0.3 and interactive.percentile(values, 95) == 0.5
    assert interactive.percentile([0.7], 95) == 0.7
