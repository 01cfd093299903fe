"""How good is a running job's time left? The sample job run whole, its ETA recorded every --every seconds.

    python bench/eta_accuracy.py [--job jobs/demo.yaml] [--every 10] [--json out.json] [--set batching.pilot=0.2]
                                 [--dtypes float32,bfloat16] [--orders longest_first] [--rows 1000] [--repeats 3]
                                 [--cpu-clock] [--steps DIR]

Runs the job into fresh temporary output directories, per compute dtype (--dtypes, engine.dtype) in both orders:
bucketing with shortest prompts first (the default), then longest first. --rows N runs N rows cycled from the
job's input (ids made unique, max_tokens varied 16-256 by a fixed pattern) instead of the input as it is.
--repeats N runs each cell (dtype x order) N times: every run's points are shown, then each point's mean and spread
(min..max) over the runs, so that a bias (the mean) is told from the machine's noise (the spread). --cpu-clock
times the job and its estimate on the process's CPU clock (cpu_clocked): on a core shared with other processes.
--steps DIR saves each run's steps (step_recorder.py) as DIR/steps_<dtype>_<order>_<run>.json, which
`bench/eta_fit_probe.py --replay` refits: what the step fit priced, from the very runs the table reports.
Beside the job's own estimate (job/eta.py: the work left simulated with the step-time model fitted on the job's own steps) it
records the row-count estimate the progress line used before (rows left / rows per second so far). Reports the error of each against the time that was really left, at 10, 25, 50 and 75 % of
the run's stepping wall time (from its first engine step to its end; model load not counted). Goal (issue 18):
within +-15 % from 25 % on in both orders, +-30 % at 10 %; the p10-p90 band holding the time really left at >= 80 %
of the points (issue 35).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

import batchrun.job.progress as progress_module
from batchrun.cpuinfo import cpu_model, cpu_flags
from batchrun.job import Job, JobSpec
from batchrun.job.eta import EtaEstimator
from step_recorder import recorded_steps, save   # bench/ is on the path when this script runs

POINTS = (0.10, 0.25, 0.50, 0.75)


def cpu_step_times(engine):
    """From now on each engine step's time is the process's CPU time from the step's start to its observers (the
    step's own work, as the engine's wall time is; what the runner does between steps stays out): engine.step is
    wrapped to note the start, and an observer registered ahead of the others sets the time that they read.
    Returns the function that undoes both."""
    started, real_step = [0.0], engine.step

    def step(*args, **kwargs):
        started[0] = time.process_time()
        return real_step(*args, **kwargs)

    def cpu_step(stats):
        stats.step_time = time.process_time() - started[0]
    engine.step = step
    stop = engine.observe(cpu_step)

    def undo():
        stop()
        del engine.step
    return undo


@contextlib.contextmanager
def cpu_clocked():
    """The job's ETA on the process's CPU clock: each engine step's time is the CPU time since the step before
    (cpu_step_times, ahead of the estimator's observer) and the estimator's clock is time.process_time. On a core shared with
    other processes, their load moves the job's wall time by tens of percent as it comes and goes, which no estimate
    from the job's own steps can foresee; the CPU clock measures the estimate as on a core of its own."""
    real = EtaEstimator.from_engine.__func__

    def from_engine(cls, engine, *args, **kwargs):
        cpu_step_times(engine)
        estimator = real(cls, engine, *args, **kwargs)
        estimator.clock = time.process_time
        return estimator

    EtaEstimator.from_engine = classmethod(from_engine)
    try:
        yield
    finally:
        EtaEstimator.from_engine = classmethod(real)


def run_recorded(job: str, order: dict, every: float, overrides: list[str], cpu_clock: bool = False,
                 steps_path: str | None = None) -> dict:
    """Run the job, recording (seconds since its first step, job ETA, row-count ETA, rows done) every `every`
    seconds (of the process's CPU time with cpu_clock, and the job's ETA on that clock: cpu_clocked). Model load and
    compilation come before the first step and are not counted."""
    records, real_tick = [], progress_module.Progress.tick
    start, first, last = None, None, [-every]
    clock = time.process_time if cpu_clock else time.monotonic

    def tick(self, engine, queued):
        nonlocal start, first
        due = real_tick(self, engine, queued)
        now = clock()
        start = start if start is not None else now
        if first is None and self.eta is not None:
            first = (now - start, self.eta.seconds_left)
        if now - last[0] >= every:
            last[0] = now
            rows = self.done - self.done_at_start
            rate = rows / max(now - (start if cpu_clock else self.start), 1e-9)
            records.append((now - start, self.eta.seconds_left if self.eta else None,
                            (self.total - self.done) / rate if rows else None, self.done,
                            self.eta.low if self.eta else None, self.eta.high if self.eta else None,
                            engine.stats.output_tokens, self.eta.output_tokens_left if self.eta else None))
        return due

    progress_module.Progress.tick = tick
    try:
        with tempfile.TemporaryDirectory() as out, (cpu_clocked() if cpu_clock else contextlib.nullcontext()), \
                recorded_steps() as steps:
            result = Job.from_yaml(job, [f"output.path={out}/run", "output.log_every_s=60",
                                         *(f"batching.{k}={str(v).lower()}" for k, v in order.items()),
                                         *overrides]).run(
                progress="log")
    finally:
        progress_module.Progress.tick = real_tick
    if steps_path:
        save(steps_path, steps, cpu_model(), job, "longest_first" if order["longest_first"] else "shortest_first",
             overrides)
    if result.status != "done":   # a SIGTERM stops the job gracefully: its time left was never reached
        raise SystemExit(f"the job was {result.status}: no errors to report for a run that did not finish")
    wall = clock() - start
    tokens = result.summary["output_tokens_this_run"]
    return {"wall_s": round(wall, 1), "rows": result.summary["rows_this_run"], "records": records,
            "first_estimate": first and first_estimate(*first, wall), "errors": errors_at(records, wall, tokens)}


def first_estimate(at: float, eta: float, wall: float) -> dict:
    """When the job's first estimate came (it may fall between two records) and its error."""
    return {"at_s": round(at, 1), "at_pct": round(100 * at / wall, 1), "eta_s": round(eta, 1),
            "actual_left_s": round(wall - at, 1), "error_pct": round(100 * (eta - (wall - at)) / (wall - at), 1)}


def errors_at(records: list, wall: float, tokens: int) -> dict:
    """% error of each estimate against the time really left, at each point of the wall time (the last record
    at or before it); beside it, the error of the output tokens it expected to be left (of `tokens` in all), which
    tells a wrong length forecast from a wrong price per step."""
    out = {}
    for point in POINTS:
        before = [r for r in records if r[0] <= point * wall]
        if not before:
            continue
        t, job_eta, row_eta, done, low, high, tokens_done, tokens_expected = before[-1]
        left, tokens_left = wall - t, tokens - tokens_done
        out[f"{round(point * 100)}%"] = {
            "at_s": round(t, 1), "rows_done": done, "actual_left_s": round(left, 1),
            "job_eta_s": None if job_eta is None else round(job_eta, 1),
            "job_error_pct": None if job_eta is None else round(100 * (job_eta - left) / left, 1),
            "row_eta_s": None if row_eta is None else round(row_eta, 1),
            "row_error_pct": None if row_eta is None else round(100 * (row_eta - left) / left, 1),
            "band_s": None if low is None else [round(low, 1), round(high, 1)],
            "band_width_pct": None if low is None or not job_eta else round(100 * (high - low) / job_eta, 1),
            "in_band": None if low is None else low <= left <= high, "tokens_left": tokens_left,
            "tokens_error_pct": None if tokens_expected is None or not tokens_left
            else round(100 * (tokens_expected - tokens_left) / tokens_left, 1)}
    return out


def cycled_max_tokens(row: int) -> int:
    """Row `row`'s max_tokens in a --rows job: 16-256 by a fixed pattern (bench/length_replay.py replays the same)."""
    return 16 * (1 + (row * 7) % 16)


def cycled_input(job: str, rows: int, directory: str) -> str:
    """`rows` rows cycled from the job's input, ids unique and max_tokens varied, as a Parquet file."""
    spec = JobSpec.from_yaml(job)
    table = pq.read_table(spec.resolve(spec.input.path))
    picks = [i % table.num_rows for i in range(rows)]
    out = table.take(picks)
    out = out.set_column(out.schema.get_field_index(spec.input.id_column), spec.input.id_column,
                         pa.array([f"r{i}" for i in range(rows)]))
    if spec.input.max_tokens_column:
        out = out.set_column(out.schema.get_field_index(spec.input.max_tokens_column), spec.input.max_tokens_column,
                             pa.array([cycled_max_tokens(i) for i in range(rows)], pa.int32()))
    path = os.path.join(directory, "input.parquet")
    pq.write_table(out, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="jobs/demo.yaml")
    parser.add_argument("--every", type=float, default=10.0)
    parser.add_argument("--json")
    parser.add_argument("--dtypes", default="auto", help="engine.dtype values, comma-separated (auto: the job's)")
    parser.add_argument("--rows", type=int, help="run this many rows cycled from the job's input")
    parser.add_argument("--orders", default="shortest_first,longest_first", help="bucketing orders to run")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each dtype x order cell")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="time the job and its ETA on the process's CPU clock (a core shared with other load)")
    parser.add_argument("--steps", metavar="DIR", help="save each run's steps here, for eta_fit_probe.py --replay")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a job-file override for every run, as `batchrun submit --set` takes")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: at least 1, got {args.repeats}")
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags())
    result = {"cpu": cpu_model() or platform.processor(), "flags": flags, "job": args.job, "overrides": args.set,
              "cores": sorted(os.sched_getaffinity(0)), "clock": "cpu" if args.cpu_clock else "wall",
              "load_before": os.getloadavg(), "runs": {}}
    print(f"{result['cpu']}; {flags}; cores {result['cores']} (pin with taskset); {result['clock']} clock; "
          f"load {' '.join(f'{x:.2f}' for x in result['load_before'])}")
    with tempfile.TemporaryDirectory() as scratch:
        overrides = list(args.set)
        if args.rows:
            overrides.append(f"input.path={cycled_input(args.job, args.rows, scratch)}")
        for dtype in args.dtypes.split(","):
            for order_name in args.orders.split(","):
                order = {"bucketing": True, "longest_first": order_name == "longest_first"}
                name = f"{dtype}/{order_name}"
                extra = [] if dtype == "auto" else [f"engine.dtype={dtype}"]
                runs = result["runs"][name] = []
                for repeat in range(args.repeats):
                    steps_path = args.steps and os.path.join(args.steps,
                                                             f"steps_{dtype}_{order_name}_{repeat + 1}.json")
                    runs.append(run_recorded(args.job, order, args.every, overrides + extra, args.cpu_clock,
                                             steps_path))
                    report(f"{name} run {repeat + 1}/{args.repeats}", runs[-1], result["cpu"], flags)
                if args.repeats > 1:
                    report_cell(name, runs)
    result["load_after"] = os.getloadavg()
    points = [e for runs in result["runs"].values() for run in runs for e in run["errors"].values()
              if e["in_band"] is not None]
    if points:
        widths = sorted(e["band_width_pct"] for e in points if e["band_width_pct"] is not None)
        print(f"band coverage: {sum(e['in_band'] for e in points)} of {len(points)} points held the time left; "
              f"band width (p90 - p10) / estimate: median {widths[len(widths) // 2]} %, {widths[0]}-{widths[-1]} %")
    print(f"load after: {' '.join(f'{x:.2f}' for x in result['load_after'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def spread(values: list[float]) -> str:
    """mean [min..max] of the values that are there (a run may have no estimate at a point yet)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{sum(values) / len(values):+.1f} [{min(values):+.1f}..{max(values):+.1f}] ({len(values)})"


def report_cell(name: str, runs: list[dict]) -> None:
    """Each point's errors over the cell's runs: mean [min..max] (runs with a value)."""
    print(f"{name}: {len(runs)} runs, wall {min(r['wall_s'] for r in runs)}-{max(r['wall_s'] for r in runs)} s")
    print(f"  {'point':>5} {'job ETA error %':>30} {'tokens-left error %':>30} {'in band':>8}")
    for point in (f"{round(p * 100)}%" for p in POINTS):
        at = [r["errors"][point] for r in runs if point in r["errors"]]
        held = [e["in_band"] for e in at if e["in_band"] is not None]
        print(f"  {point:>5} {spread([e['job_error_pct'] for e in at]):>30} "
              f"{spread([e['tokens_error_pct'] for e in at]):>30} {f'{sum(held)}/{len(held)}':>8}")
    firsts = [r["first_estimate"]["error_pct"] for r in runs if r["first_estimate"]]
    print(f"  first estimate error %: {spread(firsts)}")


def report(name: str, run: dict, cpu: str, flags: str) -> None:
    first = run["first_estimate"]
    print(f"{name}: {run['rows']} rows in {run['wall_s']} s ({cpu}; {flags}); first estimate "
          + (f"at {first['at_s']} s ({first['at_pct']} %): {first['eta_s']} s, error {first['error_pct']} %"
             if first else "never"))
    print(f"  {'point':>5} {'at s':>7} {'rows':>5} {'left s':>7} {'job ETA':>8} {'error':>7} {'p10-p90':>14} "
          f"{'width':>6} {'row ETA':>8} {'error':>7} {'tok left':>8} {'error':>7}")
    for point, e in run["errors"].items():
        band = "-" if e["band_s"] is None else f"{e['band_s'][0]}-{e['band_s'][1]}" + ("" if e["in_band"] else "!")
        print(f"  {point:>5} {e['at_s']:>7} {e['rows_done']:>5} {e['actual_left_s']:>7} {e['job_eta_s']!s:>8} "
              f"{e['job_error_pct']!s:>6}% {band:>14} {e['band_width_pct']!s:>5}% {e['row_eta_s']!s:>8} "
              f"{e['row_error_pct']!s:>6}% "
              f"{e['tokens_left']:>8} {e['tokens_error_pct']!s:>6}%")


if __name__ == "__main__":
    main()
