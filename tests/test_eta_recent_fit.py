"""The running job's step-time fit on a synthetic clock: recent steps weigh more (a load change half-way is followed,
where the fit of every step alike misprices), a fit is trusted only when the steps before the most recent ones
price those (otherwise the band widens), a swing of the machine's speed that comes back is not carried into the
rest of the job, a burst of stalls does not move the coefficients, and a decode step's per-sequence cost is told from a step's own, so the drain's small batches are
priced right before the record holds any."""
import copy

import numpy as np
import pytest

import batchrun.stepmodel.recent_fit as recent_fit
from batchrun.engine.step_stats import StepShape
from batchrun.stepmodel.linear_fit import ATTENTION_SLOWDOWN, ContextPrior, fit_linear
from batchrun.stepmodel.recent_fit import fit_recent
from test_eta import SyntheticJob, prefill_law


class Machine:
    """The prefill law, times a load factor the test changes (another process takes part of the CPU)."""

    def __init__(self):
        self.load = 1.0

    def __call__(self, shape: StepShape) -> float:
        return self.load * prefill_law(shape)


def loaded_job(rows: int = 120) -> tuple[SyntheticJob, Machine]:
    machine = Machine()
    job = SyntheticJob([20 + (i * 13) % 41 for i in range(rows)], [10 + (i * 17) % 50 for i in range(rows)],
                       jitter=0.05, step_time=machine)
    return job, machine


def record(job: SyntheticJob) -> tuple[list[StepShape], list[float]]:
    return job.eta.recorded()


def priced_over_measured(model, shapes, times) -> float:
    return sum(model.step_time(s) for s in shapes) / sum(times)


def test_a_load_change_half_way_is_followed_by_the_weighted_fit():
    job, machine = loaded_job()
    job.run_until(60)
    machine.load = 1.6           # the machine slows down half-way, for good
    job.run_until(90)
    shapes, times = record(job)
    since = len(shapes) // 4     # the steps since well after the change
    fitted = fit_recent(shapes, times)
    assert abs(priced_over_measured(fitted.model, shapes[-since:], times[-since:]) - 1) < 0.04
    # every step alike, stalls put back over the whole record (the fit before): the old speed still counts
    old = fit_linear(shapes, times, holdout_every=0)
    old.scale = sum(times) / sum(old.step_time(s) for s in shapes)
    assert priced_over_measured(old, shapes[-since:], times[-since:]) - 1 < -0.12
    eta = job.eta.estimate(job.scheduler, [])
    truth = job.time_to_finish()
    assert abs(eta.seconds_left / truth - 1) < 0.08 and eta.low <= truth <= eta.high, (eta, truth)


def test_right_after_a_load_change_the_fit_is_not_trusted_and_the_band_reaches_the_new_level():
    """40 steps after the machine slows by 1.6x for good, the level (the recent half of the record) is still the old
    one: the point is 37.5 % low, but the fit before the held-out steps priced them 37 % low, so the band widens by
    that factor, 1.6x (1 + 37 % = 1.37x did not reach the truth), and holds the truth."""
    job, machine = loaded_job()
    job.run_until(60)
    machine.load = 1.6
    for _ in range(2 * recent_fit.MIN_HELD):
        job.step()
    shapes, times = record(job)
    fitted = fit_recent(shapes, times)
    eta = job.eta.estimate(job.scheduler, [])
    truth = copy.deepcopy(job).time_to_finish()
    assert not fitted.trusted and fitted.miss == pytest.approx(-0.375, abs=0.05)
    assert eta.low <= truth <= eta.high, (eta, truth)
    assert eta.high / eta.seconds_left > 1.55


def test_a_swing_of_the_machines_speed_that_comes_back_is_not_carried_into_the_rest_of_the_job(monkeypatch):
    """60 steps at 1.3x, then the old speed again (a shared machine: 10-30 % swings for 50-100 steps, 8 recorded
    runs on an AMD EPYC). The level of the recent half of the record prices the rest within 5 %; a level read over
    the last 20 steps (as the held-out steps' level was whenever a fit was not trusted) priced it 30 % high."""
    estimates = {}
    for name, window in (("half", {}), ("last 20", {"MIN_LEVEL": 20, "LEVEL_SHARE": 0.0})):
        for key, value in window.items():
            monkeypatch.setattr(recent_fit, key, value)
        job, machine = loaded_job()
        job.run_until(60)
        machine.load = 1.3
        for _ in range(60):
            job.step()
        machine.load = 1.0
        eta = job.eta.estimate(job.scheduler, [])
        estimates[name] = eta.seconds_left / copy.deepcopy(job).time_to_finish() - 1
    assert abs(estimates["half"]) < 0.05 and estimates["last 20"] > 0.2, estimates


def test_a_burst_of_stalls_does_not_move_the_fit():
    job, _ = loaded_job()
    job.run_until(80)
    shapes, times = record(job)
    clean = fit_recent(shapes, times)
    stalled = list(times)
    for i in range(-30, -22):      # a GC pause: 8 steps in a row 0.2 s late, among the held-out steps
        stalled[i] += 0.2
    burst = fit_recent(shapes, stalled)
    assert burst.trusted and abs(burst.miss - clean.miss) < 0.01
    assert burst.model.outliers >= 8

    def unscaled(fitted) -> float:   # the record's steps as the coefficients price them, stalls not put back
        return priced_over_measured(fitted.model, shapes, times) / fitted.model.scale
    assert unscaled(burst) == pytest.approx(unscaled(clean), rel=0.005)
    # its time comes back as its share of the record's time (stalls recur), not through the coefficients
    share = 8 * 0.2 / sum(times)
    assert burst.model.scale / clean.model.scale - 1 == pytest.approx(share, rel=0.1)


def sequence_law(shape: StepShape) -> float:
    """The prefill law and, as on the CPU, what a decode token costs beyond a prefill token (its lm_head row, its
    sampling: e per sequence) and a step with a prefill chunk its own fixed cost (the prefill attention's calls)."""
    return (0.02 + 3e-4 * shape.tokens + 9e-4 * shape.seqs + 2e-5 * shape.kv_tokens + 1e-6 * shape.prefill_pairs
            + 0.008 * (shape.tokens > shape.seqs))


def test_the_drains_small_batches_are_priced_from_full_ones_by_the_per_sequence_term():
    """Half the rows done, every decode step so far a full batch (4): a step's own cost and its sequences' are one
    number to the steps. With tokens alone (the four-term fit: a sequence costs what a token does) a full batch's
    sequences went into a, and the drain's small batches that follow were priced 9 % high; with the per-sequence
    term and its prior (a sequence's cost / a token's, from the model's shapes) within 1 %; a prior half the truth
    is off by half as much as none; once the drain is in the record, the steps decide."""
    rows = 48
    job = SyntheticJob([20 + (i * 13) % 41 for i in range(rows)], [40 + (i * 37) % 160 for i in range(rows)],
                       jitter=0.03, step_time=sequence_law)
    job.run_until(rows // 2)
    seen = len(job.eta.steps)
    job.time_to_finish()
    shapes, times = record(job)
    assert not any(s.tokens == s.seqs < 4 for s in shapes[:seen])   # no small decode batch yet
    kinds = {"drain": [s.tokens == s.seqs < 4 for s in shapes], "full": [s.tokens == s.seqs == 4 for s in shapes],
             "prefill": [s.tokens > s.seqs for s in shapes]}

    def priced(model, fitted_on=seen, as_tokens=False) -> dict:
        """priced / measured of each kind of step after the fitted ones (as_tokens: each sequence one more token,
        the steps as the four-term fit saw them)."""
        out = {}
        for kind, chosen in kinds.items():
            steps = [(s, t) for s, t, c in list(zip(shapes, times, chosen))[fitted_on:] if c]
            out[kind] = sum(model.step_time(StepShape(s.tokens, s.tokens, s.kv_tokens, s.attn_pairs) if as_tokens
                                             else s) for s, _ in steps) / sum(t for _, t in steps)
        return out

    ratio = 2e-5 / 0.02
    new = priced(fit_recent(shapes[:seen], times[:seen], prior=ContextPrior(ratio, sequence_ratio=3.0)).model)
    as_tokens = [StepShape(s.tokens, s.tokens, s.kv_tokens, s.attn_pairs) for s in shapes[:seen]]
    old = priced(fit_recent(as_tokens, times[:seen], prior=ContextPrior(ratio)).model, as_tokens=True)
    assert old["drain"] > 1.07, old
    assert all(abs(r - 1) < 0.015 for r in new.values()), new
    half = priced(fit_recent(shapes[:seen], times[:seen], prior=ContextPrior(ratio, sequence_ratio=1.5)).model)
    none = priced(fit_recent(shapes[:seen], times[:seen], prior=ContextPrior(ratio)).model)
    assert abs(half["drain"] - 1) < 0.6 * abs(none["drain"] - 1), (half, none)
    whole = fit_recent(shapes, times, prior=ContextPrior(ratio, sequence_ratio=1.5)).model
    assert all(abs(r - 1) < 0.01 for r in priced(whole, fitted_on=0).values())


def test_prefill_chunks_of_one_size_do_not_split_their_time_into_a_fixed_cost():
    """A longest-first run's first steps: ten full 1,024-token chunks and one of 716, then decode steps. There a
    prefill step's fixed cost (g) and its tokens' (b x 1,024) are one number; the fit that split it put 80 ms into
    g and priced the half-size chunks that followed 42 % high (SmolLM2, bf16). g waits for steps of other sizes."""
    def law(shape: StepShape) -> float:
        return 0.02 + 2e-4 * shape.tokens + 1.5e-6 * shape.kv_tokens + 2e-7 * shape.prefill_pairs + 0.008 * (
            shape.tokens > shape.seqs)

    rng = np.random.default_rng(0)
    first = [StepShape(1024, 1 + i, 1024 * (i + 1), 1024 * (i + 1) + 400_000 + 37_000 * i) for i in range(10)]
    first += [StepShape(716, 32, 11_000, 11_000 + 40_000)] + [StepShape(32, 32, 12_000 + 32 * i, 12_000 + 32 * i)
                                                               for i in range(5)]
    times = [law(s) * rng.uniform(0.97, 1.03) for s in first]
    model = fit_linear(first, times, holdout_every=0, prior=ContextPrior(1.5e-6 / 0.02))
    half_chunks = [StepShape(450 + 10 * i, 33, 15_000, 15_000 + 450 * 900) for i in range(20)]
    assert model.g == 0.0
    assert abs(sum(model.step_time(s) for s in half_chunks) / sum(law(s) for s in half_chunks) - 1) < 0.08
    # steps of other sizes in the record: g is fitted
    more = first + half_chunks[:4]
    fitted = fit_linear(more, [law(s) for s in more], holdout_every=0, prior=ContextPrior(1.5e-6 / 0.02))
    assert fitted.g == pytest.approx(0.008, rel=0.05)


def test_a_few_short_chunks_do_not_put_the_tokens_time_into_prefill_pairs():
    """A float32 1,000-row run's first 8 recorded steps (SmolLM2, shortest first, Intel Xeon): decodes of 32 and two
    mixed steps whose new tokens and prefill pairs grow together. The free fit put their time into d (4.2e-5 s a
    pair, b = 0) and priced a long prompt's 1,024-token chunk to come at 21.7 s (about 1 s on the machine): the
    first estimate was 4.9x the time left. The prior d = pair_ratio x b splits it."""
    spec_ratio = 3.254e-4   # ModelSpec.pair_ratio of SmolLM2-135M
    shapes = [StepShape(32, 32, c, c) for c in (1228, 1260, 1292, 1324, 1356, 1388)]
    shapes += [StepShape(141, 32, 1389, 4377), StepShape(55, 32, 1416, 2060)]
    times = [0.079, 0.074, 0.074, 0.076, 0.076, 0.076, 0.204, 0.112]
    chunk = StepShape(1024, 33, 20_000, 520_000)
    free = ContextPrior(8.5e-5, sequence_ratio=0.27)
    assert fit_linear(shapes, times, holdout_every=0, prior=free).step_time(chunk) > 15
    tied = ContextPrior(8.5e-5, sequence_ratio=0.27, pair_ratio=spec_ratio * ATTENTION_SLOWDOWN)
    assert 0.5 < fit_linear(shapes, times, holdout_every=0, prior=tied).step_time(chunk) < 2.0
