"""The step-time model of a running job, fitted so that it prices the steps to come at the machine's present speed.

- Recent steps weigh more (half-life: an eighth of the record, at least MIN_HALF_LIFE steps): a shared machine's
  load changes during a job, and the steps of an hour ago price the next ones at the old speed. Old steps still
  fix what recent ones cannot tell (the prefill term, when the recent steps are all decodes).
- Outliers (a GC pause, a preempted core) are rejected by the fit (fit_linear, 3 robust sigmas); their time comes
  back as their share of the record's time (stalls recur), not as a change of the coefficients.
- The fit is trusted only when the fit on the steps before the most recent ones prices those (held out) within
  TOLERANCE. Otherwise (the load just changed, or the steps changed shape beyond what was seen) the model's level
  falls back to the most recent steps' own: measured / priced over them, and the miss is reported so that the
  band widens by it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from batchrun.stepmodel.costmodel import StepShape
from batchrun.stepmodel.linear_fit import ContextPrior, LinearModel, fit_linear

MIN_HALF_LIFE = 64      # steps
HALF_LIFE_SHARE = 1 / 8
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
    trusted: bool          # the held-out steps confirmed the fit; otherwise its level is theirs


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
    # the level: of the steps that weigh now (two half-lives) when trusted, of the held-out ones otherwise
    window = held if not trusted else min(count, int(2 * max(MIN_HALF_LIFE, count * HALF_LIFE_SHARE)))
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
