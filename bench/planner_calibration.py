"""Planner calibration on this machine: predict a job's stepping time from a pilot, run the whole job, compare.

    python bench/planner_calibration.py [--job jobs/demo.yaml] [--pilot-fraction 0.2] [--json out.json]
                                        [--set engine.dtype=bfloat16] [--cpu-clock]

1. `batchrun plan JOB --calibrate`'s path: a pilot of every k-th row (at most --pilot-fraction of the job), the
   step-time fit (linear_fit.fit_linear, as the job's ETA fits), and the whole job simulated over the real scheduler
   with it.
2. The whole job through the job runner (into a fresh temporary output directory), every engine step's shape and
   time recorded.
Reports predicted vs measured stepping time (and the job's wall time; and without the one-off cost of the job's
first steps, which build its compiled graph), simulated vs real steps and output tokens,
and an oracle: the same simulation priced by a model fitted on the full run's own steps, which separates the
error of the model's form (oracle vs measured) from the pilot's extrapolation (pilot fit vs oracle).
--cpu-clock times every step (pilot and job) by the process's CPU time (eta_accuracy.cpu_step_times): on a core
shared with other processes, whose load changes between the pilot and the job otherwise decide the comparison.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import tempfile
import time

from batchrun import LLM
from batchrun.cpuinfo import cpu_model
from batchrun.job import Job
from batchrun.job.spec import JobSpec
from batchrun.planner.calibrate import WARMUP_STEPS, run_calibration
from batchrun.planner.workload import load_workload, read_model_config
from batchrun.stepmodel.linear_fit import fit_linear
from batchrun.stepmodel.simulate import simulate, timeline
from eta_accuracy import cpu_step_times


@contextlib.contextmanager
def record_steps(llm, shapes: list, times: list, cpu_clock: bool = False):
    """Record each engine step's shape and time, as the engine reports them (cpu_clock: its CPU time)."""
    stops = [cpu_step_times(llm.engine)] if cpu_clock else []
    stops.append(llm.engine.observe(lambda stats: (shapes.append(stats.shape), times.append(stats.step_time))))
    try:
        yield None
    finally:
        for stop in stops:
            stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="jobs/demo.yaml")
    ap.add_argument("--pilot-fraction", type=float, default=0.2)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a job-file override (engine.dtype=float32, ...) for the pilot and the job alike")
    ap.add_argument("--cpu-clock", action="store_true", help="time the steps by the process's CPU time")
    ap.add_argument("--steps", help="write every measured step (pilot and full run: shape, seconds) here as JSON")
    args = ap.parse_args()

    out_dir = tempfile.mkdtemp(prefix="batchrun-calibration-")
    spec = JobSpec.from_yaml(args.job, [f"output.path={out_dir}", *args.set])
    work = load_workload(spec, read_model_config(spec.model))
    start = time.perf_counter()
    llm = LLM(model=spec.model, **spec.engine_options)
    if args.cpu_clock:
        cpu_step_times(llm.engine)
    calibration = run_calibration(spec, work, args.pilot_fraction, llm)
    del llm
    report = calibration.report
    pilot_s = time.perf_counter() - start
    gc.collect()
    print(f"pilot: {json.dumps(report['pilot'])}\nfit: {json.dumps(report['fit'])}\n"
          f"predicted: {json.dumps(report['predicted'])} ({pilot_s:.0f}s)", flush=True)

    shapes, times = [], []
    summary = Job(spec).run(progress="log", serve=lambda llm: record_steps(llm, shapes, times, args.cpu_clock)
                            ).summary
    shapes = shapes[:len(times)]
    if args.steps:   # first: the raw material survives whatever follows
        with open(args.steps, "w") as f:
            json.dump({"pilot": [[*dataclasses.astuple(s), t] for s, t in calibration.steps],
                       "full": [[*dataclasses.astuple(s), t] for s, t in zip(shapes, times)]}, f)
    measured_steps = sum(times)
    computing = [(s, t) for s, t in zip(shapes, times) if s.tokens]
    # the job's first steps build its compiled graph (one-off, not in the prediction): the error without that
    first = computing[:WARMUP_STEPS]
    steady = measured_steps - sum(t for _, t in first) + sum(calibration.model.step_time(s) for s, _ in first)
    oracle = fit_linear([s for s, _ in computing], [t for _, t in computing])
    trace = simulate(calibration.items, calibration.num_blocks, work.block_size, work.max_num_seqs,
                     work.max_num_batched_tokens, work.prefix_caching, work.keys)
    oracle_s = timeline(trace, oracle.step_time).makespan_s
    predicted = report["predicted"]["makespan_s"]
    result = {
        "job": args.job, "overrides": args.set, "clock": "cpu" if args.cpu_clock else "wall", "cpu": cpu_model(), "cores": sorted(os.sched_getaffinity(0)),
        "load": os.getloadavg(), "rows": summary["rows_done"], "pilot": report["pilot"], "fit": report["fit"],
        "predicted_stepping_s": predicted, "measured_stepping_s": round(measured_steps, 3),
        "measured_job_wall_s": summary["wall_s"],
        "error_vs_stepping_pct": round((predicted / measured_steps - 1) * 100, 1),
        "job_first_steps_s": round(sum(t for _, t in first), 3),
        "error_vs_stepping_without_first_steps_pct": round((predicted / steady - 1) * 100, 1),
        "error_vs_job_wall_pct": round((predicted / summary["wall_s"] - 1) * 100, 1),
        "steps": {"predicted": report["predicted"]["steps"], "measured": len(times)},
        "output_tokens": {"predicted": report["predicted"]["output_tokens"], "measured": summary["completion_tokens"]},
        "oracle": {"fit": oracle.to_dict(), "predicted_stepping_s": round(oracle_s, 3),
                   "error_vs_stepping_pct": round((oracle_s / measured_steps - 1) * 100, 1)},
    }
    print(json.dumps(result, indent=2))

    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"(output left in {out_dir})" if os.path.isdir(out_dir) else "")


if __name__ == "__main__":
    main()
