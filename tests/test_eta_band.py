"""The band's extrapolation term (the share of the time left spent in smaller batches than the recent steps had, or
at contexts outside their range) and its fit error (the held-out misses of the recent fits)."""
import pytest

from batchrun.engine.step_stats import StepShape
from batchrun.job.eta_band import (EXTRAPOLATION, MAX_MISS, RECENT_STEPS, Z90, band, extrapolated_share, familiar_steps,
                                   fit_error, step_spread, widen)
from batchrun.stepmodel.linear_fit import LinearModel


def decode(seqs: int) -> StepShape:
    return StepShape(tokens=seqs, seqs=seqs, kv_tokens=100 * seqs, attn_pairs=100 * seqs)


def test_the_drain_after_full_batches_widens_the_step_side():
    # the ramp-up's small batches are older than the recent steps; lately every step held 32 or 31 sequences
    record = [decode(n) for n in range(1, 32)] + [decode(32 - i % 2) for i in range(RECENT_STEPS)]
    assert familiar_steps(record).seqs == 31
    # the simulated rest: full batches for half the time, then a drain of 8 down to 1 sequence for the other half
    trace = [decode(32)] * 4 + [decode(n) for n in range(8, 0, -1)]
    times = [1.0] * 4 + [0.5] * 8
    share = extrapolated_share(trace, times, familiar_steps(record))
    assert share == pytest.approx(0.5)
    low, high = widen((0.95, 1.05), share)
    assert (low, high) == pytest.approx((0.95 - EXTRAPOLATION / 2, 1.05 + EXTRAPOLATION / 2))
    # lengths known exactly: the band is the widened step side alone
    assert band(100.0, (1.0, 1.0), (low, high)) == pytest.approx((100 * low, 100 * high))


def test_nothing_left_beyond_the_batches_seen_leaves_the_band_alone():
    record = [decode(n) for n in (4, 8, 16, 32) * 10]
    trace, times = [decode(n) for n in (32, 16, 8, 4)], [1.0, 0.8, 0.6, 0.5]
    assert extrapolated_share(trace, times, familiar_steps(record)) == 0.0
    assert widen((0.9, 1.1), 0.0) == (0.9, 1.1)
    assert extrapolated_share([], [], familiar_steps(record)) == 0.0


def test_contexts_beyond_the_recent_steps_range_widen_the_step_side():
    # shortest prompts first: lately every step read 3,000-3,900 context tokens; the rows left read 5,000
    record = [StepShape(32, 32, 3000 + i % 10 * 100, 0) for i in range(RECENT_STEPS)]
    familiar = familiar_steps(record)
    assert (familiar.seqs, familiar.context_low, familiar.context_high) == (32, 3000, 3900)
    trace = [StepShape(32, 32, 3500, 0)] * 3 + [StepShape(32, 32, 5000, 0)] + [StepShape(32, 32, 2000, 0)]
    assert extrapolated_share(trace, [1.0] * 5, familiar) == pytest.approx(0.4)


def test_the_bands_fit_error_remembers_the_recent_misses():
    # the fits so far missed the steps they had not seen by 6-8 %; the latest by 1 %: the band stays about as wide
    off = [0.08, 1 / 0.94 - 1, 0.07, 0.01]                # priced at 0.94x is 1 / 0.94 off
    assert fit_error([0.08, -0.06, 0.07, 0.01]) == pytest.approx(Z90 * (sum(x * x for x in off) / 4) ** 0.5)
    # the load just changed: the latest miss, whole, as the factor it is off by (priced at 0.6x: 1.67x off)
    assert fit_error([0.01, 0.01, -0.4]) == pytest.approx(1 / 0.6 - 1)
    assert fit_error([0.01, 0.01, 0.4]) == pytest.approx(0.4)
    assert fit_error([0.01, 0.01, -0.8]) == pytest.approx(MAX_MISS)     # priced at a fifth: a factor of 2 at most
    assert fit_error([]) == 0.0


def test_a_large_fit_miss_widens_the_band_by_a_factor_never_to_zero():
    # a fit that priced the held-out steps at 5x (miss +4): the time left may be a fifth of the estimate, not 0 s
    model = LinearModel(a=0.01, b=0.0, c=0.0)   # no recent steps to read: the band is the miss alone
    assert step_spread(model, [], [], 4.0) == pytest.approx((0.2, 5.0))
    assert step_spread(model, [], [], -0.1) == pytest.approx((1 / 1.1, 1.1))
