"""How sure the time left is: a p10-p90 band around the point estimate, from the two things it rests on.

- Output lengths: the finished rows are a sample. Resampling them (bootstrap) and asking again how many output tokens
  are left gives the spread of that count; the time left follows it (a step's cost is per token).
- The step-time model: the measured time of blocks of recent consecutive steps against what the model priced them
  at, the machine's swings (a shared CPU) and the fit's misses at the scale of a few seconds; at least as wide as
  the fit's error on steps it had not seen (fit_error: the held-out misses of recent fits, recent_fit).

The two are taken as independent and added in quadrature, each side separately. Then the share of the time left
that the simulation spends in steps unlike the recent ones (smaller batches, as in the drain at the job's end, or
contexts outside the recent steps' range, as bucketing's later rows read: extrapolated_share) widens the step
model's side by EXTRAPOLATION each way: recent steps cannot tell how well the fit prices those.
"""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import numpy as np

from batchrun.job.output_lengths import OutputLengths
from batchrun.stepmodel.costmodel import StepShape
from batchrun.stepmodel.linear_fit import LinearModel

REPLICATES = 16        # bootstrap resamples of the finished rows
Z90 = 1.2816           # the 90th percentile of a standard normal: p10-p90 is -+ Z90 sigma
STEP_BLOCK = 20        # consecutive steps per block of the step model's error
RECENT_STEPS = 400     # the steps the model's error is read from
# How far a fit that priced the recent steps well priced the drain that followed (smaller batches than it had seen
# lately): 8-15 % in bench/eta_accuracy.py, both orders and dtypes (Intel Xeon, CPU clock); the band's misses at
# 75 % of a run were all such, while recent steps agreed with the fit. Decode steps of a larger context than the
# fit had seen: a fit at 50-130 s of a 1,000-row bf16 job, shortest first, priced the decode steps of 20-50k
# context tokens that followed 6-15 % high (a context token costs less in long sequences than in short ones).
EXTRAPOLATION = 0.15
MAX_MISS = 1.0         # the most a fit's held-out miss widens the band: a factor of 2 (fit_error)


def tokens_left(lengths: OutputLengths, rows: list[tuple[int, int, int, float]]) -> float:
    """The output tokens the rows are expected to generate yet. rows: (generated, max_tokens, prompt tokens, weight)."""
    expected = functools.lru_cache(maxsize=None)(lengths.expected)
    return sum(w * (expected(g, m, p) - g) for g, m, p, w in rows)


def length_spread(lengths: OutputLengths, running: list[tuple[int, int]], rows: list[tuple[int, int, int, float]],
                  rng: random.Random, base: float) -> tuple[float, float]:
    """p10 and p90 of (output tokens left with the finished rows resampled) / base, the tokens left with the rows
    themselves (tokens_left). rows: as tokens_left takes them; running: as OutputLengths.fit takes them."""
    finished = list(lengths.finished)
    if len(finished) < 2 or base <= 0:
        return 1.0, 1.0
    ratios = []
    for _ in range(REPLICATES):
        resampled = OutputLengths(rng.choices(finished, k=len(finished)))
        resampled.fit(running)
        ratios.append(tokens_left(resampled, rows) / base)
    return float(np.quantile(ratios, 0.1)), float(np.quantile(ratios, 0.9))


def fit_error(misses) -> float:
    """How far a fit may price the steps to come off: the latest held-out miss (the load may just have changed), and
    at least Z90 x the root mean square of the recent fits' misses (one lucky small miss does not narrow the band
    while the fits before it missed by more). A miss counts as the factor it is off by, either way: steps priced at
    0.63x their time are 1.6x off (+60 %), not 37 % (the band, 1 / 1.37 to 1.37x, missed a load change of 1.6x);
    at most MAX_MISS (a factor of 2): uncapped, one check that priced its held-out steps at a fraction of their time
    kept the band 2.2-2.9x wide each way for the rest of a run (sample job, float32, longest first, AMD EPYC)."""
    priced = np.maximum(1 + np.asarray(list(misses), dtype=float), 1e-9)   # priced / measured
    off = np.minimum(np.maximum(priced, 1 / priced) - 1, MAX_MISS)
    return max(off[-1], Z90 * float(np.sqrt(np.mean(off ** 2)))) if len(off) else 0.0


def step_spread(model: LinearModel, shapes: list[StepShape], times: list[float], miss: float = 0.0
                ) -> tuple[float, float]:
    """p10 and p90 of measured / priced time over blocks of consecutive recent steps, widened to 1 / (1 + |miss|)
    and 1 + |miss|: the fit's error on steps it has not seen (fit_error), a factor each way (1 - |miss| reached 0 s
    left once a miss passed 100 %, as early fits of a longest-first run do)."""
    shapes, times = shapes[-RECENT_STEPS:], times[-RECENT_STEPS:]
    ratios = []
    for start in range(0, len(shapes) - STEP_BLOCK + 1, STEP_BLOCK):
        priced = sum(model.step_time(s) for s in shapes[start:start + STEP_BLOCK])
        if priced > 0:
            ratios.append(sum(times[start:start + STEP_BLOCK]) / priced)
    low, high = (float(np.quantile(ratios, 0.1)), float(np.quantile(ratios, 0.9))) if len(ratios) >= 2 else (1, 1)
    return min(low, 1 / (1 + abs(miss))), max(high, 1 + abs(miss))


@dataclass(frozen=True)
class Familiar:
    """The steps the recent ones tell the fit's price of: at least `seqs` sequences, and a context (KV tokens read)
    within [context_low, context_high]. Each bound is the recent steps' 5th or 95th percentile (a stray step aside)."""
    seqs: int = 0
    context_low: float = 0.0
    context_high: float = math.inf

    def knows(self, shape: StepShape) -> bool:
        return shape.seqs >= self.seqs and self.context_low <= shape.kv_tokens <= self.context_high


def familiar_steps(shapes: list[StepShape]) -> Familiar:
    recent = shapes[-RECENT_STEPS:]
    if not recent:
        return Familiar()
    contexts = [shape.kv_tokens for shape in recent]
    return Familiar(int(np.quantile([shape.seqs for shape in recent], 0.05)), float(np.quantile(contexts, 0.05)),
                    float(np.quantile(contexts, 0.95)))


def extrapolated_share(shapes: list[StepShape], step_times: list[float], familiar: Familiar) -> float:
    """The share of the simulated time left in steps unlike the recent ones (familiar_steps)."""
    total = sum(step_times)
    unfamiliar = sum(t for shape, t in zip(shapes, step_times) if not familiar.knows(shape))
    return unfamiliar / total if total > 0 else 0.0


def widen(steps: tuple[float, float], share: float) -> tuple[float, float]:
    """The step model's spread widened by EXTRAPOLATION x the share of the time left it extrapolates to."""
    return steps[0] - EXTRAPOLATION * share, steps[1] + EXTRAPOLATION * share


def band(seconds: float, lengths: tuple[float, float], steps: tuple[float, float]) -> tuple[float, float]:
    """(p10, p90) seconds left around the point estimate."""
    below = math.hypot(max(0.0, 1 - lengths[0]), max(0.0, 1 - steps[0]))
    above = math.hypot(max(0.0, lengths[1] - 1), max(0.0, steps[1] - 1))
    return seconds * max(0.0, 1 - below), seconds * (1 + above)
