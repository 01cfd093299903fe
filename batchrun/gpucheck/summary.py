"""gpucheck's results as a few lines of text, each figure beside its goal (issue 29).

    python -m batchrun.gpucheck.summary gpu.json
"""
from __future__ import annotations

import json
import sys

NOMINAL_GBPS = 4300          # the H200's device-to-device copy, measured here (KINDS.md): the bandwidth goal's base
GOALS = {"decode_bw": 0.70, "pool_share_of_free": 0.85, "int8_identical": 0.90, "vs_peer": 2.0}


def _kernels(k: dict) -> list[str]:
    rows = [f"{r['kv_dtype']} {r['gbps']:.0f} GB/s ({r['gbps'] / NOMINAL_GBPS:.0%} of 4.3 TB/s, "
            f"{r['frac_of_copy']:.0%} of copy)" for r in k["decode"]]
    return [f"decode attention (goal >= {GOALS['decode_bw']:.0%} of 4.3 TB/s at int8): " + "; ".join(rows)]


def _identity(i: dict) -> list[str]:
    rows = [f"{r['kv_cache_dtype']} KV {r['identical']:.0%} identical (max |dlogprob| {r['max_logprob_diff']:.1e})"
            for r in i["device_runs"]]
    return [f"identity vs CPU float32, {i['prompts']} prompts x {i['max_tokens']} tokens (goals: float32 100%, "
            f"int8 >= {GOALS['int8_identical']:.0%}): " + "; ".join(rows)]


def _throughput(t: dict, label: str) -> list[str]:
    lines = [f"{label}: {t['requests']} requests, ~{t['mean_prompt_tokens']}-token prompts, {t['max_tokens']} out"]
    for r in t["runs"]:
        mem = r["memory"]
        pool = (f"pool {r['pool']['gib']} GiB = {r['pool']['tokens']} tokens"
                + (f", {mem['pool_share_of_free']:.1%} of free (goal >= {GOALS['pool_share_of_free']:.0%}), "
                   f"peak {mem['peak_reserved_gib']} of {mem['device_total_gib']} GiB" if "pool_share_of_free" in mem
                   else ""))
        ratios = (f", x{r['tok_s_vs_float16']} tok/s and x{r['capacity_vs_float16']} capacity vs float16"
                  if "tok_s_vs_float16" in r and r["kv_cache_dtype"] != "float16" else "")
        split = r["step_split"]
        lines.append(f"  {r['kv_cache_dtype']}: {r['output_tok_s']} tok/s{ratios}; {pool}; split forward "
                     f"{split['forward']:.0%} sampler {split['sampler']:.0%} scheduler {split['scheduler']:.0%} "
                     f"rest {max(split['rest'], 0):.0%}; preemptions {r['preemptions']}")
    return lines


def _peer(p: dict, result: dict) -> list[str]:
    line = (f"transformers {p['transformers']} generate_batch: {p['output_tok_s']} tok/s in flight "
            f"({p['output_tok_s_wall']} over its whole call)")
    runs = result.get("throughput", {}).get("runs", [])
    fp16 = next((r for r in runs if r["kv_cache_dtype"] == "float16"), None)
    if fp16:
        line += f"; batchrun float16 KV x{fp16['output_tok_s'] / p['output_tok_s']:.2f} (goal >= x{GOALS['vs_peer']})"
    return [line]


def _interactive(i: dict) -> list[str]:
    return [f"interactive TTFT with {i['batch_requests']} batch requests running: p50 {i['ttft_p50_s']} s, "
            f"p95 {i['ttft_p95_s']} s, max {i['ttft_max_s']} s ({i['interactive_requests']} requests)"]


def summarize(result: dict) -> str:
    lines = [f"gpucheck on {result['device']}{' (DRY RUN: not measurements)' if result['dry_run'] else ''}, "
             f"{result.get('elapsed_s', '?')} s"]
    render = {"kernels": _kernels, "identity": _identity, "peer": lambda p: _peer(p, result),
              "throughput": lambda t: _throughput(t, "throughput llama-1b shape"),
              "throughput_smollm2": lambda t: _throughput(t, "throughput smollm2-135m shape"),
              "interactive": _interactive}
    for name, section in result["sections"].items():
        if "error" in section:
            lines.append(f"{name}: ERROR {section['error']}")
        elif "skipped" in section:
            lines.append(f"{name}: skipped ({section['skipped']})")
        else:
            lines += render[name](section)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m batchrun.gpucheck.summary gpu.json")
    with open(argv[0]) as f:
        print(summarize(json.load(f)))


if __name__ == "__main__":
    main()
