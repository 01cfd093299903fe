"""The step-time model of a running job, fitted so that it prices the steps to come at the machine's present speed.

- Recent steps weigh more (half-life: half the record, at least MIN_HALF_LIFE steps): the job's steps change shape
  as it goes (longer contexts, the drain's small batches), and a load that changes for good changes the prices.
- The level (measured / priced) is read over the most recent half of the record (at least MIN_LEVEL steps), steps
  far off its median left out. A shared machine's speed swings by 10-30 % for 50-100 steps at a time and comes
  back (a fit of a whole run against its own steps, 17-89-step windows: 0.77-1.38 on an AMD EPYC, 8 recorded
  runs); a level read over the last 20-35 steps carried such a swing into the price of the whole rest of the job.
  Replaying those runs (fits at 10-75 % of each, priced / measured of the steps that followed,
  bench/eta_fit_probe.py --replay): mean error 12.5 % and 75 % of points within 15 % with a 64-step half-life and
  the level of the last 2 half-lives (of the held-out steps when untrusted); 6.3 % and 92 % with these settings.
  The price of that: a load that changes for good is followed once it holds most of the level's window.
- Outliers (a GC pause, a preempted core) are rejected by the fit (fit_linear, 3 robust sigmas); their time comes
  back as their share of the record's time (stalls recur), not as a change of the coefficients.
- The fit is trusted only when the fit on the steps before the most recent ones prices those (held out) within
  TOLERANCE; the miss is reported either way and the band (job/eta_band.py) widens by it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from batchrun.stepmodel.costmodel import StepShape
from batchrun.stepmodel.linear_fit import ContextPrior, LinearModel, fit_linear

MIN_HALF_LIFE = 64      # steps
HALF_LIFE_SHARE = 1 / 2
MIN_LEVEL = 128         # steps: the level's window, at least
LEVEL_SHARE = 1 / 2     # ... and the most recent half of the record
HELD_SHARE = 0.1        # the most recent tenth of the record is held out, at least MIN_HELD steps, at most MAX_HELD
MIN_HELD, MAX_HELD = 20, 200
MIN_TRAIN = 8           # steps before the held-out ones needed to check a fit at all
TOLERANCE = 0.10        # held-out steps priced within 10 %: the fit is trusted
STALL = 0.25            # a step within 25 % of the steps' median measured / priced is never taken for a stall
LOCAL = 33              # steps around a step (odd) whose median measured / priced it is judged against as a stall


@dataclass
class RecentFit:
    model: LinearModel     # scale set: the recent level, stalls included
    miss: float | None     # priced / measured - 1 of the held-out recent steps by the fit before them; None: too few
    trusted: bool          # the held-out steps confirmed the fit


def recency_weights(count: int) -> np.ndarray:
    half_life = max(MIN_HALF_LIFE, count * HALF_LIFE_SHARE)
    return 0.5 ** (np.arange(count)[::-1] / half_life)


def fit_recent(shapes: list[StepShape], times: list[float], prior: ContextPrior | None = None) -> RecentFit:
    """The recency-weighted, outlier-rejecting fit, confirmed on the most recent steps (see the module's text).
    Raises what fit_linear raises on too few or degenerate steps."""
    count = len(shapes)
    measured = np.asarray(times, dtype=float)
    model = fit_linear(shapes, times, holdout_every=0, prior=prior, weights=recency_weights(count))
    held = min(MAX_HELD, max(MIN_HELD, int(count * HELD_SHARE)))
    miss = None
    if count - held >= MIN_TRAIN:
        try:
            before = fit_linear(shapes[:-held], times[:-held], holdout_every=0, prior=prior,
                                weights=recency_weights(count - held))
            miss = 1 / _level(_priced(before, shapes[-held:]), measured[-held:]) - 1
        except (ValueError, np.linalg.LinAlgError):
            miss = None
    trusted = miss is not None and abs(miss) <= TOLERANCE
    window = min(count, max(MIN_LEVEL, int(count * LEVEL_SHARE)))
    level = _level(_priced(model, shapes[-window:]), measured[-window:])
    model.scale = level * (1 + _stall_share(_priced(model, shapes), measured))
    return RecentFit(model, miss, trusted)


def _priced(model: LinearModel, shapes: list[StepShape]) -> np.ndarray:
    return np.array([model.step_time(s) for s in shapes], dtype=float)


def _level(priced: np.ndarray, measured: np.ndarray) -> float:
    """measured / priced over the steps, those far off the steps' median ratio (stalls, an old speed) left out."""
    ratio = measured / np.maximum(priced, 1e-12)
    middle = np.median(ratio)
    inside = np.abs(ratio - middle) <= max(3 * 1.4826 * np.median(np.abs(ratio - middle)), STALL * middle)
    return float(measured[inside].sum() / max(priced[inside].sum(), 1e-12))


def _stall_share(priced: np.ndarray, measured: np.ndarray) -> float:
    """The share of the record's time that stalls add: the time of steps far above the median measured / priced of
    the LOCAL steps around them, beyond that median (a load change is a new median, not a stall). A rate over the
    whole record: a stall recurs at its rate, a burst of them does not price every step to come."""
    ratio = measured / np.maximum(priced, 1e-12)
    local = np.median(sliding_window_view(np.pad(ratio, LOCAL // 2, mode="edge"), LOCAL), axis=1)
    above = ratio - local > np.maximum(3 * 1.4826 * np.median(np.abs(ratio - local)), STALL * local)
    expected = local * priced
    return float((measured[above] - expected[above]).sum() / max(expected.sum(), 1e-12))
