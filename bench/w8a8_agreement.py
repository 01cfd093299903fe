"""How often each engine's INT8 W8A8 keeps its own bf16 greedy output, on the same checkpoint and prompts.

    python bench/w8a8_agreement.py [--model smollm2] [--limit 32] [--max-tokens 64] [--json out.json]

The issue's quality goal for int8 (greedy identical to the 16-bit model at 64 tokens) needs a peer figure: vLLM's
CPU build runs the compressed-tensors INT8 W8A8 checkpoint that bench/bench_models.py writes (`<model>-w8a8`:
per-channel absmax weights, per-token activations, no calibration), and this bench compares each engine's W8A8
greedy tokens with the same engine's bfloat16 run of the float checkpoint. batchrun also runs its own int8 (the
float checkpoint quantized at load, under its Hadamard rotation). The prompts are the sample workload of
bench/vs_vllm.py (the first --limit rows as chat messages), every request --max-tokens long, EOS ignored; batchrun
in deterministic mode. The cross-engine row (batchrun bf16 against vLLM bf16) is the spread that no weight format
is involved in.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_models  # noqa: E402
from vs_vllm import ROOT, run_vllm, workloads  # noqa: E402


def agreement(reference: list[list[int]], candidate: list[list[int]]) -> tuple[float, float | None]:
    """The share of identical outputs and the mean first differing position over the others."""
    firsts = [next(i for i, (a, b) in enumerate(zip(r, c)) if a != b) for r, c in zip(reference, candidate) if r != c]
    return 1 - len(firsts) / len(reference), (sum(firsts) / len(firsts) if firsts else None)


def run_batchrun(model_path: str, prompts: list[list[int]], max_tokens: int, **engine) -> list[list[int]]:
    import gc

    from batchrun import LLM, SamplingParams
    llm = LLM(model=model_path, dtype="bfloat16", deterministic=True, **engine)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    del llm
    gc.collect()
    return [list(o.token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 or mid (its -w8a8 twin is built on first use)")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from batchrun.cpuinfo import cpu_flags, cpu_model
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "avx512_vnni", "amx", "avx512f", "avx2")))
    print(f"CPU: {cpu_model()}; flags: {' '.join(flags)}; cores {os.cpu_count()}", flush=True)
    float_path, w8a8_path = bench_models.model_path(args.model), bench_models.model_path(f"{args.model}-w8a8")
    work = workloads(AutoTokenizer.from_pretrained(float_path), str(ROOT / "sample_data" / "prompts.parquet"),
                     args.limit, ["sample"])
    work["sample"]["max_tokens"] = [args.max_tokens] * len(work["sample"]["prompts"])
    prompts = work["sample"]["prompts"]

    def vllm(path: str) -> list[list[int]]:
        result = run_vllm(path, "bfloat16", work, max_num_seqs=128, default_threads=False, one_core=None)
        return result["workloads"]["sample"]["token_ids"]

    runs = {"vLLM bf16": vllm(float_path), "vLLM W8A8 checkpoint": vllm(w8a8_path),
            "batchrun bf16": run_batchrun(float_path, prompts, args.max_tokens),
            "batchrun W8A8 checkpoint": run_batchrun(w8a8_path, prompts, args.max_tokens),
            "batchrun int8 at load (rotated)": run_batchrun(float_path, prompts, args.max_tokens,
                                                            quantization="int8")}
    pairs = [("vLLM W8A8 checkpoint", "vLLM bf16"), ("batchrun W8A8 checkpoint", "batchrun bf16"),
             ("batchrun int8 at load (rotated)", "batchrun bf16"), ("batchrun bf16", "vLLM bf16")]
    print(f"\n{args.model}, {len(prompts)} prompts, {args.max_tokens} greedy tokens each, bfloat16 compute")
    print("| candidate | against | greedy identical | first difference at token |")
    print("|---|---|---:|---:|")
    rows = []
    for candidate, reference in pairs:
        same, first = agreement(runs[reference], runs[candidate])
        print(f"| {candidate} | {reference} | {same:.0%} | {'-' if first is None else f'{first:.1f}'} |")
        rows.append(dict(candidate=candidate, reference=reference, identical=same, first_difference=first))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=cpu_model(), flags=flags, rows=rows, token_ids=runs)))


if __name__ == "__main__":
    main()
