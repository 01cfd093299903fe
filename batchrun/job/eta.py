"""Time left for a running job from the work left, not the rows left, priced by the planner's step model.

Each engine step the runner records the step's shape and time. Every so often the step-time model
t = a + b x tokens + c x context + d x prefill pairs (the fit `batchrun plan --calibrate` uses) is refitted on the recent steps and
the work left is simulated over the real scheduler: the engine's running requests as they stand (their KV in the
cache), its waiting ones, the rows read but not admitted, and the rows not read yet (prompt lengths drawn from
the rows read so far, bucketed as the feed will). Output lengths come from the rows finished so far, with the
running ones and those cut by max_tokens as lower bounds (Kaplan-Meier), since outputs stop early and short ones
finish first. While long prompts keep the KV pool full, the steps cannot tell a context token's cost from the
step's own; the fit then leans on a prior from the bytes each reads (costmodel.ContextPrior).
"""
from __future__ import annotations

import functools
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from batchrun.admission_order import PILOT_MIN_ROWS, length_class
from batchrun.stepmodel.costmodel import ContextPrior, LinearModel, ModelSpec, StepShape, fit_linear
from batchrun.stepmodel.simulate import WorkItem, simulate, timeline

log = logging.getLogger("batchrun.job")
WARMUP_STEPS = 2          # a run's first steps pay one-off costs (allocation, compilation): not fitted
MIN_STEPS = 8             # steps needed before the first fit (a young fit is damped by the median of three)
MIN_SMALL_STEPS = 4       # steps of at most half the largest step's tokens before the fit prices such steps
UNSEEN_SHARE = 0.25       # until then, the most of a simulation's steps that may be such steps
KEEP = 4096               # recent steps and finished lengths kept (and saved for a resumed run)
MAX_SIMULATED = 2000      # rows not started beyond this are simulated as an evenly spaced sample, scaled up
SIM_COST_SHARE = 0.02     # re-simulate at most so often that simulating costs <= 2% of the job's time


@dataclass
class Eta:
    seconds_left: float
    finish_at: float            # epoch seconds
    output_tokens_left: int     # expected, with the observed output lengths


class KaplanMeier:
    """The distribution of a row's natural output length (in tokens: where it would stop with no max_tokens) from
    rows that stopped (events) and rows known only to run at least so far (censored: those cut by their
    max_tokens, and those still running). The mass beyond every observation is unbounded: any max_tokens cuts it."""

    def __init__(self, events: list[int], censored: list[int]):
        events, censored = np.sort(np.array(events, dtype=float)), np.sort(np.array(censored, dtype=float))
        values, deaths = np.unique(events, return_counts=True)
        # a row censored at n ran at least n tokens: it is at risk at every length up to n
        at_risk = (len(events) - np.searchsorted(events, values, side="left")
                   + len(censored) - np.searchsorted(censored, values, side="left"))
        survival = np.cumprod(1 - deaths / at_risk)
        self.values = values
        self.mass = -np.diff(np.concatenate([[1.0], survival]))
        self.tail = survival[-1] if len(survival) else 1.0

    def expected(self, generated: int, max_tokens: int) -> float:
        """E[min(length, max_tokens) | length > generated]."""
        above = self.values > generated
        values, mass = self.values[above], self.mass[above]
        total = mass.sum() + self.tail
        if total <= 1e-12:
            return float(max_tokens)
        return float((np.minimum(values, max_tokens) * mass).sum() + max_tokens * self.tail) / total


class OutputLengths:
    """Output lengths by prompt length (a question and an article to summarise stop at different points, and
    bucketing runs them at different times). Lengths in tokens, not as a share of max_tokens: a row with a large
    max_tokens is most often one that stops early, so a share would price it at what rows cut by a small max_tokens
    did. Finished rows that stopped are observations; rows cut by max_tokens and running rows are censored ones."""

    MIN_EVENTS = PILOT_MIN_ROWS   # finished rows of a class (or it and its neighbours) for its own distribution

    def __init__(self, finished: list[tuple[int, int, bool]] = ()):
        # (prompt tokens, tokens generated, cut by max_tokens)
        self.finished: deque[tuple[int, int, bool]] = deque(map(tuple, finished), maxlen=KEEP)
        self._all = KaplanMeier([], [])               # nothing observed yet: every row runs to max_tokens
        self._by_class: dict[int, KaplanMeier] = {}

    def fit(self, running: list[tuple[int, int]]) -> None:
        """running: (prompt tokens, tokens generated so far) of the rows in the engine."""
        finished = [(length_class(p), n, cut) for p, n, cut in self.finished]
        censored = [(length_class(p), n, True) for p, n in running]

        def km(rows) -> KaplanMeier:
            return KaplanMeier([n for _, n, cut in rows if not cut], [n for _, n, cut in rows if cut])

        self._all = km(finished + censored)
        self._by_class = {}
        for c in {k for k, _, _ in finished}:
            # the class's own rows once there are enough: a neighbour's rows, often all cut by their max_tokens,
            # would count as rows still running at every length below their cut and push the class's lengths up
            for reach in (0, 1):
                near = [row for row in finished if abs(row[0] - c) <= reach]
                if len(near) >= self.MIN_EVENTS:
                    self._by_class[c] = km(near + [row for row in censored if abs(row[0] - c) <= reach])
                    break

    def expected(self, generated: int, max_tokens: int, prompt_tokens: int) -> int:
        """Expected total output tokens of a row that has generated `generated` without stopping."""
        km = self._by_class.get(length_class(prompt_tokens), self._all)
        return min(max_tokens, max(generated + 1, round(km.expected(generated, max_tokens))))


class EtaEstimator:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool, rows_to_read: int, window: int, bucketing: bool, longest_first: bool,
                 prior: ContextPrior | None = None, saved: dict | None = None, clock=time.monotonic,
                 wall_clock=time.time, min_interval_s: float = 30.0):
        self.prior = prior   # c ~ ratio x a, for a record whose context sums hardly vary (a full pool)
        self.pool = (num_blocks, block_size, max_num_seqs, max_num_batched_tokens, prefix_caching)
        self.rows_to_read, self.window = rows_to_read, window
        self.bucketing, self.longest_first = bucketing, longest_first
        self.clock, self.wall_clock, self.min_interval_s = clock, wall_clock, min_interval_s
        saved = saved or {}
        # (tokens, seqs, context, attention pairs, seconds); a record saved before the pairs were kept: no prefill term
        self.steps: deque[tuple[int, int, int, int, float]] = deque(
            (tuple(s) if len(s) == 5 else (*s[:3], s[2], s[3]) for s in saved.get("steps", [])), maxlen=KEEP)
        self.lengths = OutputLengths(saved.get("output_lengths", []))
        self.overhead = float(saved.get("overhead", 1.0))   # wall time / time inside steps (the runner's own work)
        self.prompt_sample: list[tuple[int, int]] = []       # (prompt tokens, max_tokens) of rows read, a reservoir
        self.rows_read = 0
        self._random = random.Random(0)
        self._run_steps, self._run_step_s = 0, 0.0
        self._run_start: float | None = None
        self._last: tuple[float, Eta] | None = None          # (clock at the simulation, its estimate)
        self._recent: deque[tuple[float, float]] = deque(maxlen=3)   # (clock, seconds left) of the last simulations
        self._next_simulation = 0.0                          # clock time of the next simulation
        self._warned = False

    # -- observations ------------------------------------------------------------------------------------------
    def observe_rows(self, rows) -> None:
        """Rows the feed has read and tokenized (they are no longer 'not read')."""
        for row in rows:
            self.rows_read += 1
            if row.error:
                continue
            item = (len(row.token_ids), row.params.max_tokens)
            if len(self.prompt_sample) < KEEP:
                self.prompt_sample.append(item)
            elif (j := self._random.randrange(self.rows_read)) < KEEP:
                self.prompt_sample[j] = item

    @classmethod
    def from_engine(cls, engine, rows_to_read: int, batching, saved: dict | None = None) -> "EtaEstimator":
        """An estimator for a job on this engine (its pool, step caps and context prior), observing its steps."""
        config = engine.config
        eta = cls(num_blocks=engine.block_manager.num_blocks, block_size=config.block_size,
                  max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                  prefix_caching=config.enable_prefix_caching, rows_to_read=rows_to_read, window=batching.window,
                  bucketing=batching.bucketing, longest_first=batching.longest_first, prior=context_prior(engine),
                  saved=saved)
        engine.observe(lambda stats: eta.observe_step(stats.shape, stats.step_time))
        return eta

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        if self._run_start is None:
            self._run_start = self.clock() - seconds
        self._run_steps += 1
        self._run_step_s += seconds
        if shape.tokens and self._run_steps > WARMUP_STEPS:
            self.steps.append((shape.tokens, shape.seqs, shape.kv_tokens, shape.attn_pairs, seconds))

    def observe_finished(self, generated: int, max_tokens: int, prompt_tokens: int) -> None:
        self.lengths.finished.append((prompt_tokens, generated, generated >= max_tokens))

    def state(self) -> dict:
        """What a resumed run starts from."""
        return {"steps": list(self.steps), "output_lengths": list(self.lengths.finished),
                "overhead": round(self.overhead, 4)}

    # -- the estimate ------------------------------------------------------------------------------------------
    def estimate(self, scheduler, queued) -> Eta | None:
        """From the engine's scheduler (its running and waiting requests) and the rows read but not admitted; None
        until a fit can price the work left (_fit). Re-simulates when the last simulation is old enough; otherwise
        counts down from it."""
        now = self.clock()
        if now >= self._next_simulation:
            self._resimulate(now, scheduler, queued)
        if self._last is None:
            return None
        at, eta = self._last
        left = max(0.0, eta.seconds_left - (now - at))
        return Eta(left, eta.finish_at, eta.output_tokens_left)

    def _resimulate(self, now: float, scheduler, queued) -> None:
        fitted = self._fit()
        if fitted is None:
            return
        start = self.clock()   # the estimator's own clock: a test's synthetic clock makes this cost 0, not the CPU's
        try:
            eta = self._simulate(*fitted, scheduler.running, scheduler.waiting, queued)
        except RuntimeError as exc:   # e.g. a simulated request the pool cannot hold: the estimate is advisory
            if not self._warned:
                log.warning("time left: the simulation failed (%s); the estimate is not updated", exc)
                self._warned = True
            self._next_simulation = now + self.min_interval_s
            return
        # often while the fit is young (a quarter of the run so far), then every min_interval_s, and never so often
        # that simulating costs more than SIM_COST_SHARE of the job
        ran = now - self._run_start if self._run_start is not None else 0.0
        cost = self.clock() - start
        self._next_simulation = now + max(min(self.min_interval_s, 0.25 * ran), cost / SIM_COST_SHARE)
        if eta is None:   # the work left runs steps of a size the record cannot price yet
            return
        # one fit on a young or noisy record can be far off: report the median of the last three, each aged to now
        self._recent.append((now, eta.seconds_left))
        left = float(np.median([seconds - (now - at) for at, seconds in self._recent]))
        self._last = (now, Eta(left, self.wall_clock() + left, eta.output_tokens_left))

    def _fit(self) -> tuple[LinearModel, float] | None:
        """The step-time model from the recorded steps, and the step size (tokens) up to which it has not seen enough
        steps to price one (0: none). A run's first steps are often all full prefill chunks: they tell the time
        per token, not what a decode step costs (its own cost and its context's); a fit on them made the sample
        job's first estimate 1.9-2.4x the time left, while the prefill steps that followed it were priced right."""
        if len(self.steps) < MIN_STEPS:
            return None
        shapes = [StepShape(t, s, c, p) for t, s, c, p, _ in self.steps]
        times = [seconds for *_, seconds in self.steps]
        try:
            model = fit_linear(shapes, times, holdout_every=0, prior=self.prior)
        except (ValueError, np.linalg.LinAlgError):
            return None
        model.scale = sum(times) / max(sum(model.step_time(s) for s in shapes), 1e-12)
        if self._run_steps >= MIN_STEPS and self._run_step_s > 0:
            self.overhead = max(1.0, (self.clock() - self._run_start) / self._run_step_s)
        half = max(shape.tokens for shape in shapes) / 2
        return model, (half if sum(shape.tokens <= half for shape in shapes) < MIN_SMALL_STEPS else 0)

    def _simulate(self, model: LinearModel, unseen_up_to: float, running, waiting, queued) -> Eta | None:
        """None when more than UNSEEN_SHARE of the simulated steps are of a size the model has not seen enough of."""
        self.lengths.fit([(r.num_prompt_tokens, len(r.output_token_ids)) for r in running])
        fresh = functools.lru_cache(maxsize=None)(functools.partial(self.lengths.expected, 0))   # (max_tokens, prompt)
        started = [WorkItem(r.num_tokens, self._left(r), r.num_computed_tokens) for r in running]
        started += [WorkItem(r.num_tokens, self._left(r)) for r in waiting]
        queued = [WorkItem(len(row.token_ids), fresh(row.params.max_tokens, len(row.token_ids))) for row in queued]
        unread = max(0, self.rows_to_read - self.rows_read)
        pending = len(queued) + unread
        stride = max(1, math.ceil(pending / MAX_SIMULATED))
        sample = queued[::stride] + self._unread_sample(unread, stride, fresh)
        items = started + sample
        if not items:
            return Eta(0.0, self.wall_clock(), 0)
        trace = simulate(items, *self.pool)
        if sum(shape.tokens <= unseen_up_to for shape in trace.shapes) > UNSEEN_SHARE * len(trace.shapes):
            return None
        line = timeline(trace, model.step_time)
        seconds = line.makespan_s
        if stride > 1:   # the rows left out cost what the sample cost while rows were still being admitted
            seconds += (pending / len(sample) - 1) * (line.makespan_s - line.drain_s) * len(sample) / len(items)
        seconds *= self.overhead
        tokens = sum(i.output_tokens for i in started) + round(
            sum(i.output_tokens for i in sample) * pending / max(len(sample), 1))
        return Eta(seconds, self.wall_clock() + seconds, tokens)

    def _left(self, request) -> int:
        """Expected output tokens still to come for a request in the engine."""
        generated = len(request.output_token_ids)
        return self.lengths.expected(generated, request.params.max_tokens, request.num_prompt_tokens) - generated

    def _unread_sample(self, count: int, stride: int, fresh) -> list[WorkItem]:
        """Every stride-th row not read yet, as the feed will admit them: prompt lengths cycled from the rows read,
        sorted within each window when bucketing."""
        if not count or not self.prompt_sample:
            return []
        sample, window = self.prompt_sample, max(1, self.window // stride)
        items = [WorkItem(p, fresh(m, p))
                 for p, m in (sample[i % len(sample)] for i in range(math.ceil(count / stride)))]
        if self.bucketing:
            for start in range(0, len(items), window):
                items[start:start + window] = sorted(items[start:start + window], key=lambda i: i.prompt,
                                                     reverse=self.longest_first)
        return items


def context_prior(engine) -> ContextPrior:
    """The engine's KV bytes per context token over the bytes of its weights (every expert counted: a decode step
    of a batch reads most of them)."""
    weights = ModelSpec.from_config(engine.hf_config).num_params * engine.dtype.itemsize
    return ContextPrior.from_bytes(engine.kv_bytes_per_token, weights)


def clock_text(at: datetime, now: datetime) -> str:
    return at.strftime("%H:%M" if at.date() == now.date() else "%a %H:%M")


def duration_text(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    minutes = round(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}" if minutes >= 60 else f"{minutes} min"


def deadline_verdict(finish_at: float, deadline: datetime, job_path: str) -> tuple[bool, str]:
    """(on track, a line for the log)."""
    now = datetime.now()
    predicted = datetime.fromtimestamp(finish_at)
    if predicted <= deadline:
        return True, f"on track: predicted {clock_text(predicted, now)}, deadline {clock_text(deadline, now)}"
    late = (predicted - deadline).total_seconds()
    return False, (f"late by ~{duration_text(late)} at this rate (deadline {clock_text(deadline, now)}): "
                   f"`batchrun plan {job_path} --deadline {deadline.isoformat(timespec='minutes')}` suggests the "
                   f"GPUs that finish in time")
