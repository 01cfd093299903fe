"""Every engine step a job's ETA observes (shape, wall and CPU seconds), the rows it saw finish and its prior,
recorded while a job runs; saved in the file format `bench/eta_fit_probe.py --replay` reads."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time

import batchrun.job.eta as eta_module
from batchrun.engine.step_stats import StepShape


@contextlib.contextmanager
def recorded_steps():
    """Yields {"steps": [(tokens, seqs, kv_tokens, attn_pairs, seconds, CPU seconds, shared_kv_tokens)], "finished":
    [(prompt tokens, generated, max_tokens)], "prior": the ETA's ContextPrior}, filled while the job inside runs. CPU
    seconds: the process's CPU time since the step before (the step and the runner's work around it), which another
    process on the same core does not inflate as it does the step's wall time."""
    record = {"steps": [], "finished": [], "prior": None}
    cpu = [time.process_time()]
    estimator = eta_module.EtaEstimator
    real_observe, real_finished = estimator.observe_step, estimator.observe_finished

    def observe(self, shape, seconds, output_tokens=0):
        now = time.process_time()
        record["steps"].append((shape.tokens, shape.seqs, shape.kv_tokens, shape.attn_pairs, seconds, now - cpu[0],
                                shape.shared_kv_tokens))
        cpu[0], record["prior"] = now, self.prior
        return real_observe(self, shape, seconds, output_tokens)

    def finished(self, generated, max_tokens, prompt_tokens):
        record["finished"].append((prompt_tokens, generated, max_tokens))
        return real_finished(self, generated, max_tokens, prompt_tokens)

    estimator.observe_step, estimator.observe_finished = observe, finished
    try:
        yield record
    finally:
        estimator.observe_step, estimator.observe_finished = real_observe, real_finished


def shape_of(step: list) -> StepShape:
    """A recorded step's shape (no shared context in a record made before it was counted)."""
    return StepShape(*step[:4], shared_kv_tokens=step[6] if len(step) > 6 else 0)


def save(path: str, record: dict, cpu: str, job: str, order: str, overrides: list[str]) -> None:
    prior = record["prior"]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"cpu": cpu, "job": job, "order": order, "overrides": overrides,
                   "prior": prior and dataclasses.asdict(prior), "steps": record["steps"],
                   "finished": record["finished"]}, f)
