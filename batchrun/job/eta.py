"""Time left for a running job from the work left, not the rows left, priced by the planner's step model.

Each engine step the runner records the step's shape and time. Every so often the step-time model
t = a + b x tokens + c x context + d x prefill pairs + e x sequences + g x [prefill in the step] (the fit
`batchrun plan --calibrate` uses, linear_fit.LinearModel) is refitted, recent
steps weighing more and checked on the most recent ones (stepmodel/recent_fit.py), and the work left is simulated
over the real scheduler: the engine's running requests as they stand (their KV in the cache), its waiting ones, the
rows read but not admitted, and the rows not read yet (prompt lengths drawn from the rows read so far, bucketed as
the feed will). Output lengths come from the rows finished so far, with the
running ones and those cut by max_tokens as lower bounds (Kaplan-Meier), since outputs stop early and short ones
finish first; each simulated request's is drawn at its own quantile of that distribution (antithetic_strata), so
that the simulated drain is as long as the longest outputs make it. While long prompts keep the KV pool full, the
steps cannot tell a context token's cost from the step's own; the fit then leans on a prior from the bytes each
reads, as it does for a sequence's cost against a step's own while every decode step is a full batch
(linear_fit.ContextPrior).
"""
from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from batchrun.job.eta_band import (Familiar, band, extrapolated_share, familiar_steps, fit_error, length_spread,
                                   step_spread, tokens_left, widen)
from batchrun.job.output_lengths import KEEP, OutputLengths
from batchrun.stepmodel.costmodel import StepShape
from batchrun.stepmodel.linear_fit import ContextPrior, LinearModel
from batchrun.stepmodel.recent_fit import TOLERANCE, fit_recent
from batchrun.stepmodel.simulate import WorkItem, simulate, timeline

log = logging.getLogger("batchrun.job")
WARMUP_STEPS = 2          # a run's first steps pay one-off costs (allocation, compilation): not fitted
MIN_STEPS = 8             # steps needed before the first fit (a young fit is damped by the median of three)
MIN_SMALL_STEPS = 4       # steps of at most half the largest step's tokens before the fit prices such steps
UNSEEN_SHARE = 0.25       # until then, the most of a simulation's steps that may be such steps
MAX_SIMULATED = 2000      # rows not started beyond this are simulated as an evenly spaced sample, scaled up
SIM_COST_SHARE = 0.02     # re-simulate at most so often that simulating costs <= 2% of the job's time
EARLY_COST_SHARE = 0.05   # ... but sooner once the finished rows have doubled, while simulating has cost <= 5% of it
MISSES_KEPT = 8           # the held-out misses of the last fits, which the band's fit error is read from
OVERHEAD_FITS = 8         # the runner's own work (wall / time inside steps) is read over the last 8 fits' span


@dataclass
class Eta:
    seconds_left: float
    finish_at: float            # epoch seconds
    output_tokens_left: int     # expected, with the observed output lengths
    low: float | None = None    # p10 and p90 of the seconds left (eta_band), None when not known
    high: float | None = None

    def aged(self, seconds: float, tokens: int, now: float) -> "Eta":
        """The same estimate once `seconds` of its work are done and `tokens` more generated, at wall time `now`."""
        def left(x):
            return None if x is None else max(0.0, x - seconds)
        return Eta(left(self.seconds_left), now + left(self.seconds_left), max(0, self.output_tokens_left - tokens),
                   left(self.low), left(self.high))


@dataclass
class Simulation:
    """One simulation's time left, and the work done since, priced as it priced the work left: the estimate counts
    down by the steps that really ran, not by the clock. Counted down by the clock, an estimate some % off when it
    was made is off by more at each second until the next simulation (40-60 s later on a 1,000-row job, where a
    simulation costs about a second): the bf16 longest-first job's estimate went from -22 % to -35 % in the 50 s
    before its 75 % point (fits of that part of the run priced the steps that followed at 0.82-0.92x). Counted down
    by their price, the miss stays the simulation's own; on steps priced right the two are the same."""
    seconds_left: float
    model: LinearModel
    overhead: float        # wall time / time inside steps, as the simulation's time left was scaled by
    finished: int          # rows finished when it was made (its output lengths were read from them)
    output_tokens: int     # tokens generated when it was made
    done: float = 0.0      # priced seconds of the steps run since

    def observe(self, shape: StepShape) -> None:
        self.done += self.overhead * self.model.step_time(shape)

    @property
    def left(self) -> float:
        return self.seconds_left - self.done


class EtaEstimator:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool, rows_to_read: int, window: int, bucketing: bool, longest_first: bool,
                 prior: ContextPrior | None = None, saved: dict | None = None, clock=time.monotonic,
                 wall_clock=time.time, min_interval_s: float = 30.0,
                 run_decodes_alone: Callable[[int], None] | None = None):
        """run_decodes_alone(n): the scheduler's (Scheduler.run_decodes_alone), to measure decode steps early."""
        self.prior = prior   # c ~ ratio x a, for a record whose context sums hardly vary (a full pool)
        self.run_decodes_alone = run_decodes_alone
        self.pool = (num_blocks, block_size, max_num_seqs, max_num_batched_tokens, prefix_caching)
        self.rows_to_read, self.window = rows_to_read, window
        self.bucketing, self.longest_first = bucketing, longest_first
        self.clock, self.wall_clock, self.min_interval_s = clock, wall_clock, min_interval_s
        saved = saved or {}
        # (tokens, seqs, context, attention pairs, shared context, seconds) of each step; a record saved by an older
        # version lacks the shared context (read as 0), or the pairs too (read as a decode step's)
        self.steps: deque[tuple] = deque((_upgraded(tuple(s)) for s in saved.get("steps", [])), maxlen=KEEP)
        self.lengths = OutputLengths(saved.get("output_lengths", []))
        self.overhead = float(saved.get("overhead", 1.0))   # wall time / time inside steps (the runner's own work)
        self.prompt_sample: list[tuple[int, int]] = []       # (prompt tokens, max_tokens) of rows read, a reservoir
        self.rows_read = 0
        self._random = random.Random(0)
        self._bootstrap = random.Random(1)                   # the band's resamples (eta_band)
        self._run_steps, self._run_step_s = 0, 0.0
        self._run_start: float | None = None
        self._last: tuple[Simulation, Eta] | None = None     # the newest simulation and the estimate it gave
        self._output_tokens = 0                              # generated so far, as the engine counts them
        self._recent: deque[Simulation] = deque(maxlen=3)    # the last simulations
        self._misses: deque[float] = deque(maxlen=MISSES_KEPT)      # held-out misses of the last fits (eta_band)
        self._marks: deque[tuple[float, float]] = deque(maxlen=OVERHEAD_FITS)   # (clock, time inside steps) at fits
        self._next_simulation = 0.0                          # clock time of the next simulation
        self._gated = False   # the last simulation gave no estimate for want of small steps (_fit); retried on them
        self._asked_for_decodes = False
        self._simulation_cost = (0.0, 0.0)                   # (all simulations, the last one), estimator's clock
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
                  bucketing=batching.bucketing, longest_first=batching.longest_first,
                  prior=ContextPrior.of_engine(engine), saved=saved,
                  run_decodes_alone=engine.scheduler.run_decodes_alone)
        engine.observe(lambda stats: eta.observe_step(stats.shape, stats.step_time, stats.output_tokens))
        return eta

    def observe_step(self, shape: StepShape, seconds: float, output_tokens: int = 0) -> None:
        """output_tokens: generated so far (cumulative), to count the estimate's tokens left down between
        simulations."""
        self._output_tokens = output_tokens
        if self._run_start is None:
            self._run_start = self.clock() - seconds
        self._run_steps += 1
        self._run_step_s += seconds
        for simulation in self._recent:
            simulation.observe(shape)
        if shape.tokens and self._run_steps > WARMUP_STEPS:
            self.steps.append((shape.tokens, shape.seqs, shape.kv_tokens, shape.attn_pairs, shape.shared_kv_tokens,
                               seconds))
            self._ask_for_decodes()

    def recorded(self) -> tuple[list[StepShape], list[float]]:
        """The recorded steps' shapes and seconds."""
        return ([StepShape(t, s, c, p, shared_kv_tokens=shared) for t, s, c, p, shared, _ in self.steps],
                [seconds for *_, seconds in self.steps])

    def _ask_for_decodes(self) -> None:
        """Once the record holds MIN_STEPS - MIN_SMALL_STEPS steps, the small steps it still lacks are asked of the
        scheduler as steps of decodes alone, so that the first fit (at MIN_STEPS) can price decode steps. Longest
        first, the sample's first small steps came only once the long prompts filled the KV pool, 11-13 % into the
        run, and the first estimate with them (4-6 % now)."""
        if self.run_decodes_alone is None or self._asked_for_decodes or len(self.steps) < MIN_STEPS - MIN_SMALL_STEPS:
            return
        self._asked_for_decodes = True
        if (missing := MIN_SMALL_STEPS - self._small_steps()) > 0:
            self.run_decodes_alone(missing)

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
        counts down from it by the steps run since, at its prices (Simulation)."""
        now = self.clock()
        if (now >= self._next_simulation or (self._gated and self._small_steps() >= MIN_SMALL_STEPS)
                or self._lengths_grew(now)):
            self._resimulate(now, scheduler, queued)
        if self._last is None:
            return None
        simulation, eta = self._last
        return eta.aged(simulation.done, self._output_tokens - simulation.output_tokens, self.wall_clock())

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
        self._simulation_cost = (self._simulation_cost[0] + cost, cost)
        self._next_simulation = now + max(min(self.min_interval_s, 0.25 * ran), cost / SIM_COST_SHARE)
        self._gated = eta is None
        if eta is None:   # the work left runs steps of a size the record cannot price yet: again once it can
            return
        # one fit on a young or noisy record can be far off: report the median of the last three, each counted down
        # to now, of those whose output lengths were read from rows that have not doubled since (_superseded)
        simulation = Simulation(eta.seconds_left, fitted[0], self.overhead, len(self.lengths.finished),
                                self._output_tokens)
        self._recent.append(simulation)
        left = float(np.median([s.left for s in self._recent if not _superseded(s.finished, simulation.finished)]))
        scale = left / eta.seconds_left if eta.seconds_left > 0 else 1.0   # the band moves with the point
        self._last = (simulation, Eta(left, self.wall_clock() + left, eta.output_tokens_left,
                                      None if eta.low is None else eta.low * scale,
                                      None if eta.high is None else eta.high * scale))

    def _lengths_grew(self, now: float) -> bool:
        """The finished rows have doubled (and grown by 4 at least) since the last estimate, and simulating once more
        keeps its cost within EARLY_COST_SHARE of the run so far. The first estimate reads the output lengths from a
        handful of finished rows (2-4 at 7-8 % of a longest-first 1,000-row job, whose tokens left it put 25-28 %
        high), and a simulation of 1,000 rows costs about a second here (estimates 40-60 s apart at SIM_COST_SHARE):
        the first estimate, +33 %, still stood at a quarter of the run (bf16, AMD EPYC)."""
        if self._last is None or self._run_start is None:
            return False
        spent, last = self._simulation_cost
        return (_superseded(self._last[0].finished, len(self.lengths.finished))
                and spent + last <= EARLY_COST_SHARE * (now - self._run_start))

    def _fit(self) -> tuple[LinearModel, float] | None:
        """The step-time model from the recorded steps, and the step size (tokens) up to which it has not seen enough
        steps to price one (0: none). A run's first steps are often all full prefill chunks: they tell the time
        per token, not what a decode step costs (its own cost and its context's); a fit on them made the sample
        job's first estimate 1.9-2.4x the time left, while the prefill steps that followed it were priced right."""
        if len(self.steps) < MIN_STEPS:
            return None
        shapes, times = self.recorded()
        try:
            fitted = fit_recent(shapes, times, prior=self.prior)
        except (ValueError, np.linalg.LinAlgError):
            return None
        model = fitted.model
        if fitted.miss is not None:
            self._misses.append(fitted.miss)
        if self._run_steps >= MIN_STEPS and self._run_step_s > 0:
            self._read_overhead()
        return (model, (self._half_largest() if self._small_steps() < MIN_SMALL_STEPS else 0),
                step_spread(model, shapes, times, fit_error(self._misses) if self._misses else TOLERANCE),
                familiar_steps(shapes))

    def _read_overhead(self) -> None:
        """Wall time / time inside steps since OVERHEAD_FITS fits ago (since the run's start before that): the
        runner's work at the start (reading and tokenizing rows, simulating them all) priced the rest of a
        1,000-row job 1.6-1.9 % high when read over the whole run (1.027-1.030 where 1.011-1.014 followed)."""
        now = self.clock()
        if not self._marks:
            self._marks.append((self._run_start, 0.0))
        then, inside = self._marks[0]
        if self._run_step_s > inside:
            self.overhead = max(1.0, (now - then) / (self._run_step_s - inside))
        self._marks.append((now, self._run_step_s))

    def _half_largest(self) -> float:
        return max(tokens for tokens, *_ in self.steps) / 2

    def _small_steps(self) -> int:
        """Recorded steps of at most half the largest one's tokens (the decode steps, when the first were full
        prefill chunks)."""
        half = self._half_largest() if self.steps else 0
        return sum(tokens <= half for tokens, *_ in self.steps)

    def _simulate(self, model: LinearModel, unseen_up_to: float, steps_spread: tuple[float, float],
                  familiar: Familiar, running, waiting, queued_rows) -> Eta | None:
        """None when more than UNSEEN_SHARE of the simulated steps are of a size the model has not seen enough of."""
        in_engine = [(r.num_prompt_tokens, len(r.output_token_ids)) for r in running]
        self.lengths.fit(in_engine)
        queued_rows = list(queued_rows)
        unread = max(0, self.rows_to_read - self.rows_read)
        pending = len(queued_rows) + unread
        stride = max(1, math.ceil(pending / MAX_SIMULATED))
        # (tokens: ids or a prompt length, prompt tokens, generated, max_tokens, computed) of every request simulated.
        # Every request by its own token ids: with prefix caching the simulated pool shares their common prefixes (a
        # chat template, a repeated prompt; with the running ones too) as the engine's will; lengths alone priced
        # every prompt token as computed
        requests = [(tuple(r.token_ids), r.num_prompt_tokens, len(r.output_token_ids), r.params.max_tokens,
                     r.num_computed_tokens) for r in running]
        requests += [(tuple(r.token_ids), r.num_prompt_tokens, len(r.output_token_ids), r.params.max_tokens, 0)
                     for r in waiting]
        started = len(requests)
        requests += [(tuple(row.token_ids), len(row.token_ids), 0, row.params.max_tokens, 0)
                     for row in queued_rows[::stride]]
        requests += [(p, p, 0, m, 0) for p, m in self._unread_in_feed_order(unread, stride)]
        if not requests:
            return Eta(0.0, self.wall_clock(), 0)
        sampled = len(requests) - started
        runs = []   # (seconds, share extrapolated) of each draw
        for quantiles in antithetic_strata(len(requests)):
            items = [WorkItem(tokens, self.lengths.draw(generated, max_tokens, prompt, u) - generated, computed,
                              generated)
                     for (tokens, prompt, generated, max_tokens, computed), u in zip(requests, quantiles)]
            trace = simulate(items, *self.pool)
            if sum(shape.tokens <= unseen_up_to for shape in trace.shapes) > UNSEEN_SHARE * len(trace.shapes):
                return None
            line = timeline(trace, model.step_time)
            seconds = line.makespan_s
            if stride > 1:   # the rows left out cost what the sample cost while rows were still being admitted
                seconds += (pending / sampled - 1) * (line.makespan_s - line.drain_s) * sampled / len(items)
            runs.append((seconds, extrapolated_share(trace.shapes, line.step_times, familiar)))
        seconds = self.overhead * float(np.mean([seconds for seconds, _ in runs]))
        weight = pending / max(sampled, 1)
        rows = [(generated, max_tokens, prompt, 1.0 if i < started else weight)
                for i, (_, prompt, generated, max_tokens, _) in enumerate(requests)]
        tokens = tokens_left(self.lengths, rows)
        steps_spread = widen(steps_spread, float(np.mean([share for _, share in runs])))
        low, high = band(seconds, length_spread(self.lengths, in_engine, rows, self._bootstrap, tokens), steps_spread)
        return Eta(seconds, self.wall_clock() + seconds, round(tokens), low, high)

    def _unread_keys(self, count: int, stride: int) -> list[tuple[int, int]]:
        """(prompt tokens, max_tokens) of every stride-th row not read yet, cycled from the rows read."""
        sample = self.prompt_sample
        return [sample[i % len(sample)] for i in range(math.ceil(count / stride))] if count and sample else []

    def _unread_in_feed_order(self, count: int, stride: int) -> list[tuple[int, int]]:
        """The same rows as the feed will admit them: sorted within each window when bucketing."""
        window = max(1, self.window // stride)
        keys = self._unread_keys(count, stride)
        if self.bucketing:
            for start in range(0, len(keys), window):
                keys[start:start + window] = sorted(keys[start:start + window], key=lambda k: k[0],
                                                    reverse=self.longest_first)
        return keys


def _upgraded(step: tuple) -> tuple:
    """A saved step as (tokens, seqs, context, attention pairs, shared context, seconds)."""
    if len(step) == 4:    # (tokens, seqs, context, seconds): its pairs those of decodes
        step = (*step[:3], step[2], step[3])
    return step if len(step) == 6 else (*step[:4], 0, step[4])


def _superseded(finished_then: int, finished_now: int) -> bool:
    """The finished rows have doubled (and grown by 4 at least): the output lengths read then are superseded, and a
    simulation made from them leaves the median of the last three. In a float32 longest-first 1,000-row job (AMD
    EPYC) the first estimate read the lengths from 5 finished rows (tokens left +24.5 %, estimate +27.6 %); at a
    quarter of the run, 112 rows done, the estimate still stood +23.2 % while the tokens left were within 2.4 % and
    a fit of the steps so far priced the rest 1.04x (eta_fit_probe.py --replay). Rerun with its simulations logged:
    the median of those from 11, 37 and 77 rows said 568.7 s left where the newest said 514.7, and it stood 78 s."""
    return finished_now >= max(2 * finished_then, finished_then + 4)


def antithetic_strata(count: int) -> tuple[list[float], list[float]]:
    """Two sets of quantiles, one per simulation, at which the simulated requests' output lengths are drawn: (k +
    0.5) / count, k = 0 .. count - 1, in an order fixed by the count, and each mirrored (1 - u). Every request at its
    expected length stops about when the others do, and the simulated job's drain (its last steps, as a few requests
    finish long outputs) came out far shorter than the real one: 449 simulated steps against 539 real after step 182
    of a bf16 longest-first run of the sample job (bench/eta_fit_probe.py; the time left 9 % low priced by the same
    fit). Stratified draws keep the tokens left near the expected count while the lengths spread as the finished
    rows' do; the mirrored pair halves the luck of one draw (which requests come last with long outputs): one
    draw's simulations still missed the real step count by 23 % twice in a run, a long row drawn short."""
    order = list(range(count))
    random.Random(count).shuffle(order)
    quantiles = [(k + 0.5) / count for k in order]
    return quantiles, [1 - u for u in quantiles]
