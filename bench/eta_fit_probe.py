"""Where a running job's time left goes wrong: the schedule it simulates, or the price it puts on each step.

    python bench/eta_fit_probe.py [--job jobs/demo.yaml] [--order shortest_first|longest_first] [--set KEY=VALUE]
                                  [--steps steps.json]
    python bench/eta_fit_probe.py --replay steps.json [more.json ...] [--cpu-time] [--one-context-term]

Runs the job once, recording every engine step (shape and measured time), every step-time fit the ETA makes and
every simulation it runs (two per estimate: eta.antithetic_strata). Then, for each simulation, sets the simulated
steps beside the steps that really followed (count, tokens, sequences, KV read, prefill pairs) and prices both with
that moment's fit, against the measured time of the real ones; and, per fit, the priced / measured ratio of the real steps that followed it, by kind of step.
A simulation matching the real steps with a fit pricing them high is a step-model problem, not a scheduling one.

--replay refits recorded runs (--steps) with today's fit (stepmodel/recent_fit.py, the run's priors) on their first
10 ... 75 % of steps and prices the rest, by kind of step, without running the job, then the mean error over every
run and point: a change to the fit measured on the same steps. --cpu-time prices the steps' CPU time instead of
their wall time: on a core shared with another process, its load moves the wall time of a step by tens of percent,
not its CPU time. Runs of the same job and order repeat the same steps (greedy outputs, a deterministic scheduler):
replayed together, their measured seconds are set side by side by tenth of the run, which tells the machine's
run-to-run speed (the same steps, different times) from a step model's misprice (the same times, priced wrong).
--one-context-term replays the fit as it was before shared context was counted (every context token at c).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import batchrun.job.eta as eta_module  # noqa: E402
from batchrun.cpuinfo import cpu_model  # noqa: E402
from batchrun.job import Job  # noqa: E402
from batchrun.job.eta import WARMUP_STEPS  # noqa: E402
from batchrun.stepmodel.costmodel import StepShape  # noqa: E402
from batchrun.stepmodel.linear_fit import ContextPrior  # noqa: E402
from batchrun.stepmodel.recent_fit import fit_recent  # noqa: E402
from step_recorder import recorded_steps, save, shape_of  # noqa: E402

BATCH_BINS = ((1, 8), (8, 16), (16, 24), (24, 10**9))
REPLAY_AT = (0.1, 0.25, 0.4, 0.5, 0.6, 0.75)


def record(job: str, order: str, overrides: list[str]) -> tuple[dict, dict, list]:
    """(the job's steps, finished rows and prior as step_recorder records them, {steps seen: fit}, [(steps seen,
    trace)])."""
    fits, sims = {}, []
    estimator = eta_module.EtaEstimator
    real_fit, real_simulate = estimator._fit, eta_module.simulate

    with recorded_steps() as steps:
        def fit(self):
            fitted = real_fit(self)
            if fitted is not None:
                fits[len(steps["steps"])] = fitted[0]
            return fitted

        def simulate(items, *args, **kwargs):
            trace = real_simulate(items, *args, **kwargs)
            sims.append((len(steps["steps"]), trace))
            return trace

        estimator._fit, eta_module.simulate = fit, simulate
        try:
            with tempfile.TemporaryDirectory() as out:
                Job.from_yaml(job, [f"output.path={out}/run", "output.log_every_s=60",
                                    f"batching.longest_first={str(order == 'longest_first').lower()}", *overrides]
                              ).run(progress="log")
        finally:
            estimator._fit, eta_module.simulate = real_fit, real_simulate
    return steps, fits, sims


def report(steps: list, fits: dict, sims: list) -> None:
    def price(model, shapes):
        return np.array([model.step_time(shape) for shape in shapes])

    real_shapes = [shape_of(step) for step in steps]
    measured = np.array([step[4] for step in steps])
    print("simulated / real steps after each simulation, and both priced by that moment's fit")
    for at, trace in sims:
        sim = [sum(getattr(s, f) for s in trace.shapes) for f in ("tokens", "seqs", "kv_tokens", "attn_pairs")]
        real = [sum(step[i] for step in steps[at:]) for i in range(4)]
        line = (f"  after step {at}: steps {len(trace.shapes)}/{len(steps) - at}, tokens {sim[0]}/{real[0]}, "
                f"seqs {sim[1]}/{real[1]}, kv {sim[2]}/{real[2]}, prefill pairs {sim[3]}/{real[3]}")
        if at in fits:
            line += (f"; priced {price(fits[at], trace.shapes).sum():.1f} / {price(fits[at], real_shapes[at:]).sum():.1f}"
                     f" s, measured {measured[at:].sum():.1f} s")
        print(line)
    print("each fit's priced / measured over the real steps that followed it")
    for at, model in fits.items():
        print(f"  fit at step {at}: " + kinds_priced(price(model, real_shapes[at:]), measured[at:], real_shapes[at:]))


def kinds_priced(priced: np.ndarray, measured: np.ndarray, shapes: list[StepShape]) -> str:
    """priced / measured over all steps, decode steps by batch size, and steps with a prefill chunk."""
    tokens, seqs = np.array([s.tokens for s in shapes]), np.array([s.seqs for s in shapes])
    parts = [f"all {priced.sum() / max(measured.sum(), 1e-9):.3f}"]
    for lo, hi in BATCH_BINS:
        kind = (seqs >= lo) & (seqs < hi) & (tokens <= seqs)
        if kind.any():
            parts.append(f"decode {lo}-{min(hi - 1, seqs.max())} seqs {priced[kind].sum() / measured[kind].sum():.3f}"
                         f" ({kind.sum()})")
    prefill = tokens > seqs
    if prefill.any():
        parts.append(f"with prefill {priced[prefill].sum() / measured[prefill].sum():.3f} ({prefill.sum()})")
    return ", ".join(parts)


def replay(paths: list[str], cpu_time: bool, one_context_term: bool = False) -> None:
    errors, runs = [], {}
    for path in paths:
        with open(path) as f:
            run = runs[path] = json.load(f)
        prior = run.get("prior") and ContextPrior(**run["prior"])
        kept = [step for step in run["steps"][WARMUP_STEPS:] if step[0]]   # as the ETA records them
        shapes = [shape_of(step) for step in kept]
        if one_context_term:   # the shape before shared context was counted: all of it priced at c
            shapes = [dataclasses.replace(shape, shared_kv_tokens=0) for shape in shapes]
        measured = np.array([step[5 if cpu_time else 4] for step in kept])
        print(f"{path}: {run['cpu']}, {run['order']}, overrides {run['overrides']}, {len(kept)} steps, "
              f"{'CPU' if cpu_time else 'wall'} time, prior {prior}")
        for share in REPLAY_AT:
            at = int(share * len(kept))
            model = fit_recent(shapes[:at], list(measured[:at]), prior=prior).model
            priced = np.array([model.step_time(s) for s in shapes[at:]])
            errors.append(priced.sum() / measured[at:].sum() - 1)
            print(f"  fit on the first {round(100 * share)} %: " + kinds_priced(priced, measured[at:], shapes[at:]))
    same_steps({path: run["steps"] for path, run in runs.items()})
    size = np.abs(errors)
    print(f"{len(paths)} runs x {len(REPLAY_AT)} points, all steps that followed: mean |priced / measured - 1| "
          f"{100 * size.mean():.1f} %, within 15 % at {100 * np.mean(size <= 0.15):.0f} % of points, worst "
          f"{100 * size.max():.1f} %")


def same_steps(runs: dict[str, list]) -> None:
    """Runs ({path: recorded steps}) whose step shapes are identical: each one's measured seconds by tenth of the
    run, and the slowest over the fastest run in each tenth."""
    groups: dict[tuple, list[tuple[str, np.ndarray]]] = {}
    for path, steps in runs.items():
        groups.setdefault(tuple(tuple(step[:4]) for step in steps), []).append(
            (path, np.array([step[4] for step in steps])))
    for group in (group for group in groups.values() if len(group) > 1):
        tenths = np.array([[part.sum() for part in np.array_split(seconds, 10)] for _, seconds in group])
        print(f"the same {len(group[0][1])} steps in {len(group)} runs, seconds by tenth of the run:")
        for (path, _), row in zip(group, tenths):
            print(f"  {' '.join(f'{t:6.1f}' for t in row)}  {row.sum():7.1f}  {path}")
        spread = tenths.max(axis=0) / tenths.min(axis=0)
        print(f"  {' '.join(f'{x:6.2f}' for x in spread)}  {tenths.sum(axis=1).max() / tenths.sum(axis=1).min():7.2f}"
              "  slowest / fastest")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "jobs", "demo.yaml"))
    ap.add_argument("--order", default="shortest_first", choices=("shortest_first", "longest_first"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a job-file override")
    ap.add_argument("--steps", help="write every recorded step [tokens, seqs, kv_tokens, attn_pairs, seconds, CPU "
                                    "seconds, shared_kv_tokens] and finished row [prompt tokens, generated, "
                                    "max_tokens] here (JSON), to replay fits and forecasts offline")
    ap.add_argument("--replay", metavar="STEPS_JSON", nargs="+",
                    help="refit recorded runs (--steps) instead of running one")
    ap.add_argument("--cpu-time", action="store_true", help="with --replay: price the steps' CPU time")
    ap.add_argument("--one-context-term", action="store_true",
                    help="with --replay: count no shared context (every context token priced alike, as before)")
    args = ap.parse_args()
    if args.replay:
        return replay(args.replay, args.cpu_time, args.one_context_term)
    print(f"CPU: {cpu_model()}; job {args.job}, {args.order}, overrides {args.set}")
    recorded, fits, sims = record(args.job, args.order, args.set)
    if args.steps:
        save(args.steps, recorded, cpu_model(), args.job, args.order, args.set)
    report(recorded["steps"], fits, sims)


if __name__ == "__main__":
    main()
