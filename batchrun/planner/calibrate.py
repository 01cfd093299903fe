"""Calibration: run a pilot of the job on this machine, fit t = a + b x tokens + c x sum(context) + d x prefill
pairs + e x sequences + g x [prefill in the step] on its steps (linear_fit.fit_linear, with the priors the job's ETA
uses), then predict the whole job by simulating it with the fitted model (same scheduler, same pool
size)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from batchrun.job.spec import JobSpec
from batchrun.planner.workload import Workload
from batchrun.stepmodel.costmodel import StepShape
from batchrun.stepmodel.linear_fit import ContextPrior, LinearModel, fit_linear
from batchrun.stepmodel.simulate import WorkItem, simulate, timeline

WARMUP_STEPS = 2   # the first steps pay one-off costs (allocation, kernel selection): not fitted


def pilot_indices(n: int, fraction: float) -> list[int]:
    """Every k-th request, spread over the job, at most `fraction` of it (at least one)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"--pilot-fraction: must be in (0, 1], got {fraction!r}")
    k = max(1, round(1 / fraction))
    return list(range(0, n, k))[:max(1, int(n * fraction))]


def run_pilot(llm, spec: JobSpec, items: list[WorkItem]) -> tuple[list[StepShape], list[float], list[int], float]:
    """Drive llm.engine.step() over the items; each step's shape and time (as the engine reports them), the
    measured output length of each item, and the wall time of the stepping loop."""
    engine = llm.engine
    shapes: list[StepShape] = []
    times: list[float] = []
    ids = []
    for item in items:
        params = spec.sampling_params(max_tokens=item.output_tokens)
        ids.append(engine.add_request(list(item.prompt), params).request_id)
    stop_observing = engine.observe(lambda stats: (shapes.append(stats.shape), times.append(stats.step_time)))
    lengths = {}
    start = time.perf_counter()
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    lengths[out.request_id] = len(out.token_ids)
    finally:
        stop_observing()
    wall = time.perf_counter() - start
    return shapes, times, [lengths.get(i, 0) for i in ids], wall


def calibrate(spec: JobSpec, work: Workload, fraction: float = 0.2, llm=None) -> dict:
    """Pilot, fit, held-out error, and the full job's predicted stepping time on this machine."""
    return run_calibration(spec, work, fraction, llm).report


@dataclass
class Calibration:
    model: LinearModel         # the fitted step-time model
    items: list[WorkItem]      # the whole job, output lengths as expected from the pilot
    num_blocks: int            # the engine's KV pool, as the job would run it
    report: dict
    steps: list[tuple[StepShape, float]]   # the pilot's fitted steps: shape, measured seconds


def run_calibration(spec: JobSpec, work: Workload, fraction: float = 0.2, llm=None) -> Calibration:
    from batchrun import LLM
    if llm is None:
        llm = LLM(model=spec.model, **spec.engine_options)
    picked = pilot_indices(len(work.items), fraction)
    pilot = [work.items[i] for i in picked]
    shapes, times, lengths, wall = run_pilot(llm, spec, pilot)
    shapes, times = [s for s, t in zip(shapes, times) if s.tokens][WARMUP_STEPS:], \
        [t for s, t in zip(shapes, times) if s.tokens][WARMUP_STEPS:]
    model = fit_linear(shapes, times, prior=ContextPrior.of_engine(llm.engine))   # the job's ETA fits the same way
    # the fit gives the shape of the step time; the pilot's total gives its level, stalls of this machine included
    model.scale = sum(times) / max(sum(model.step_time(s) for s in shapes), 1e-12)
    # expected output lengths: measured for pilot rows; the pilot's finish ratios, in turn, for the others
    ratios = [n / max(i.output_tokens, 1) for n, i in zip(lengths, pilot)]
    measured = dict(zip(picked, lengths))
    items = [WorkItem(it.prompt, measured[i] if i in measured else
                      max(1, round(it.output_tokens * ratios[i % len(ratios)])))
             for i, it in enumerate(work.items)]
    num_blocks = llm.engine.block_manager.num_blocks
    trace = simulate(items, num_blocks, work.block_size, work.max_num_seqs, work.max_num_batched_tokens,
                     work.prefix_caching, work.keys)
    full = timeline(trace, model.step_time)
    report = {"pilot": {"requests": len(pilot), "fraction": round(len(pilot) / len(work.items), 3),
                        "steps": len(times) + WARMUP_STEPS, "wall_s": round(wall, 3), "output_tokens": sum(lengths),
                        "mean_output_over_max_tokens": round(sum(ratios) / len(ratios), 3)},
              "fit": model.to_dict(), "kv_blocks": num_blocks, "block_size": work.block_size,
              "predicted": {"requests": len(items), "steps": trace.steps, "output_tokens": full.output_tokens,
                            "makespan_s": round(full.makespan_s, 3), "drain_s": round(full.drain_s, 3),
                            "preemptions": trace.preemptions}}
    return Calibration(model, items, num_blocks, report, list(zip(shapes, times)))
