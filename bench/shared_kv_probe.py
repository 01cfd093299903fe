"""How much of a decode step's context is shared by the sequences beside it, and what one context term of the step
fit makes of it (README: the ETA on an Intel Xeon with AMX).

    python bench/shared_kv_probe.py [--job jobs/demo.yaml] [--rows 1000] [--dtype bfloat16] [--order shortest_first]
                                    [--steps steps.json]

Runs the job once (as bench/eta_accuracy.py runs a cell), recording each engine step's shape, whose shared context
(StepShape.shared_kv_tokens, from the block tables) is the context in blocks an earlier sequence of the same step
reads too. Then, on the run's pure decode steps of 24-32 sequences, fits by least squares on the first half
of the run t = a + c x context + e x sequences, and t = a + cu x unique + cs x shared + e x sequences, and prices
every tenth of the run with both, and gives the split fitted on the whole run (the prior a step term for shared context
needs). Where the shared share grows over the run, the first prices the tail high.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eta_accuracy import cycled_input, report, run_recorded  # noqa: E402

from batchrun.cpuinfo import cpu_model  # noqa: E402


def tenths(steps: np.ndarray, shared: np.ndarray) -> None:
    n = len(steps)
    decode = (steps[:, 0] == steps[:, 1]) & (steps[:, 1] >= 24)
    at, kv, sh, seqs, t = np.flatnonzero(decode), steps[decode, 2], shared[decode], steps[decode, 1], steps[decode, 4]
    first_half = at < n / 2
    one = np.c_[np.ones(len(t)), kv, seqs]
    two = np.c_[np.ones(len(t)), kv - sh, sh, seqs]
    c1 = np.linalg.lstsq(one[first_half], t[first_half], rcond=None)[0]
    c2 = np.linalg.lstsq(two[first_half], t[first_half], rcond=None)[0]
    whole = np.linalg.lstsq(two, t, rcond=None)[0]
    print(f"first half's decode steps: one context term {c1[1] * 1e9:.0f} ns a token; unique {c2[1] * 1e9:.0f} and "
          f"shared {c2[2] * 1e9:.0f} ns a token. The whole run's: unique {whole[1] * 1e9:.0f}, shared "
          f"{whole[2] * 1e9:.0f} ns (shared / unique {whole[2] / whole[1]:.2f})")
    print("tenth  decode steps  context (k)  shared %  priced/measured: one term  unique + shared")
    for q in range(10):
        w = (at >= q * n / 10) & (at < (q + 1) * n / 10)
        if w.any():
            print(f"{q + 1:5d}  {w.sum():12d}  {kv[w].mean() / 1e3:11.1f}  {100 * sh[w].sum() / kv[w].sum():8.1f}  "
                  f"{np.mean(one[w] @ c1 / t[w]):25.3f}  {np.mean(two[w] @ c2 / t[w]):14.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default="jobs/demo.yaml")
    ap.add_argument("--rows", type=int, help="run this many rows cycled from the job's input")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--order", choices=["shortest_first", "longest_first"], default="shortest_first")
    ap.add_argument("--steps", metavar="FILE", help="keep the recorded steps here, for eta_fit_probe.py --replay")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"engine.dtype={args.dtype}"]
        if args.rows:
            overrides.append(f"input.path={cycled_input(args.job, args.rows, tmp)}")
        steps_path = args.steps or os.path.join(tmp, "steps.json")
        run = run_recorded(args.job, {"bucketing": True, "longest_first": args.order == "longest_first"}, 10.0,
                           overrides, steps_path=steps_path)
        with open(steps_path) as f:   # tokens, sequences, context, attention pairs, seconds, CPU s, shared context
            steps = np.array(json.load(f)["steps"], dtype=float)
    report(f"{args.dtype}/{args.order}: the job's ETA", run, cpu_model(), "")
    tenths(steps[:, :5], steps[:, 6])


if __name__ == "__main__":
    main()
