"""How much of a decode step's context is shared by the sequences beside it, and what one context term of the step
fit makes of it (README: the ETA on an Intel Xeon with AMX).

    python bench/shared_kv_probe.py [--job jobs/demo.yaml] [--rows 1000] [--dtype bfloat16] [--order shortest_first]

Runs the job once (as bench/eta_accuracy.py runs a cell), the engine's steps also counting, from the block
tables, the context in blocks that an earlier sequence of the same step reads: the decode kernel reads such a block
once for the group. Then, on the run's pure decode steps of 24-32 sequences, fits by least squares on the first half
of the run t = a + c x context + e x sequences, and t = a + cu x unique + cs x shared + e x sequences, and prices
every tenth of the run with both, and gives the split fitted on the whole run (the prior a step term for shared context
needs). Where the shared share grows over the run, the first prices the tail high.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eta_accuracy import cycled_input, run_recorded  # noqa: E402

import batchrun.engine.engine as engine_module  # noqa: E402
from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.step_stats import StepShape  # noqa: E402


def shared_tokens(scheduled, block_size: int) -> int:
    """Context tokens, after the step, in blocks that an earlier sequence of the step also reads."""
    seen, shared = set(), 0
    for request, n in scheduled:
        context = request.num_computed_tokens + n
        for i, block in enumerate(request.block_table[:math.ceil(context / block_size)]):
            if block in seen:
                shared += min(block_size, context - i * block_size)
            seen.add(block)
    return shared


class CountingShape(StepShape):
    """The engine's StepShape.of, also appending (tokens, sequences, context, shared) of each step to `record`. The
    engine's only: the ETA's simulations run the same scheduler."""
    record: list = []
    block_size: int = EngineConfig.block_size

    @classmethod
    def of(cls, scheduled) -> StepShape:
        shape = StepShape.of(scheduled)
        cls.record.append((shape.tokens, shape.seqs, shape.kv_tokens, shared_tokens(scheduled, cls.block_size)))
        return shape


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
    args = ap.parse_args()
    with open(args.job) as f:
        CountingShape.block_size = (yaml.safe_load(f).get("engine") or {}).get("block_size", EngineConfig.block_size)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"engine.dtype={args.dtype}"]
        if args.rows:
            overrides.append(f"input.path={cycled_input(args.job, args.rows, tmp)}")
        steps_path = os.path.join(tmp, "steps.json")
        engine_module.StepShape = CountingShape
        try:
            run_recorded(args.job, {"bucketing": True, "longest_first": args.order == "longest_first"}, 10.0,
                         overrides, steps_path=steps_path)
        finally:
            engine_module.StepShape = StepShape
        with open(steps_path) as f:   # tokens, sequences, context, attention pairs, seconds
            steps = np.array([s[:5] for s in json.load(f)["steps"]], dtype=float)
    counted = np.array(CountingShape.record[len(CountingShape.record) - len(steps):], dtype=float)
    if not np.array_equal(counted[:, :3], steps[:, :3]):   # the job's steps are the last: the warm-up's come first
        sys.exit("the counted steps do not line up with the recorded ones")
    tenths(steps, counted[:, 3])


if __name__ == "__main__":
    main()
