"""The one-call GPU check, run dry on the CPU: every section present, the pools sized, outputs compared."""
import json

from batchrun import gpucheck


def test_gpucheck_dry_run_reports_every_section(tmp_path, tiny_model):
    out = tmp_path / "gpucheck.json"
    result = gpucheck.main(["--dry-run", "--model", tiny_model[0], "--prompts", "3", "--max-tokens", "4",
                            "--kv-cache-memory", "4MiB", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [r["kv_cache_dtype"] for r in result["runs"]] == ["float16", "int8", "fp8"]
    assert {r["kv_dtype"] for r in result["kernels"]["decode"]} == {"float16", "int8", "fp8"}
    for run in result["runs"]:
        assert run["pool"]["blocks"] > 0 and run["output_tokens"] == 3 * 4
        assert 0 <= run["identical_to_cpu_float32"] <= 1
        split = run["step_split"]
        assert split["forward"] > 0 and split["sampler"] > 0 and split["scheduler"] > 0
        assert abs(sum(split[k] for k in ("forward", "sampler", "scheduler", "rest")) - 1) < 1e-6
    # float16 KV against float32 KV on the same CPU: a tiny random model keeps the greedy tokens
    assert result["runs"][0]["identical_to_cpu_float32"] == 1.0
