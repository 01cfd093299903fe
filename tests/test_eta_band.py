"""The band's extrapolation term: the share of the time left spent in smaller batches than the recent steps had."""
import pytest

from batchrun.engine.step_stats import StepShape
from batchrun.job.eta_band import EXTRAPOLATION, RECENT_STEPS, band, extrapolated_share, familiar_batch, widen


def decode(seqs: int) -> StepShape:
    return StepShape(tokens=seqs, seqs=seqs, kv_tokens=100 * seqs, attn_pairs=100 * seqs)


def test_the_drain_after_full_batches_widens_the_step_side():
    # the ramp-up's small batches are older than the recent steps; lately every step held 32 or 31 sequences
    record = [decode(n) for n in range(1, 32)] + [decode(32 - i % 2) for i in range(RECENT_STEPS)]
    assert familiar_batch(record) == 31
    # the simulated rest: full batches for half the time, then a drain of 8 down to 1 sequence for the other half
    trace = [decode(32)] * 4 + [decode(n) for n in range(8, 0, -1)]
    times = [1.0] * 4 + [0.5] * 8
    share = extrapolated_share(trace, times, familiar_batch(record))
    assert share == pytest.approx(0.5)
    low, high = widen((0.95, 1.05), share)
    assert (low, high) == pytest.approx((0.95 - EXTRAPOLATION / 2, 1.05 + EXTRAPOLATION / 2))
    # lengths known exactly: the band is the widened step side alone
    assert band(100.0, (1.0, 1.0), (low, high)) == pytest.approx((100 * low, 100 * high))


def test_nothing_left_beyond_the_batches_seen_leaves_the_band_alone():
    record = [decode(n) for n in (4, 8, 16, 32) * 10]
    trace, times = [decode(n) for n in (32, 16, 8, 4)], [1.0, 0.8, 0.6, 0.5]
    assert extrapolated_share(trace, times, familiar_batch(record)) == 0.0
    assert widen((0.9, 1.1), 0.0) == (0.9, 1.1)
    assert extrapolated_share([], [], 8) == 0.0
