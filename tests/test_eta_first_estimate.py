"""When the running job's first estimate comes: not from full prefill chunks alone (they cannot price the decode
steps to come), as soon as the record holds smaller steps, which the estimator asks the scheduler for, and at once
for a job of full chunks alone."""
from batchrun.job.eta import MIN_SMALL_STEPS, MIN_STEPS
from test_eta import SyntheticJob, prefill_law


def small_steps(job: SyntheticJob) -> int:
    """Recorded steps of at most half the largest one's tokens."""
    sizes = [tokens for tokens, *_ in job.eta.steps]
    return sum(n <= max(sizes) / 2 for n in sizes)


def test_full_prefill_chunks_alone_do_not_price_the_decode_steps_to_come():
    # 8 rows of 300 prompt tokens and 100 output tokens. Fitted on the first steps (all full 64-token chunks), the
    # three-term fit's c took the chunks' attention, and an estimate from that fit was 2.1x the time left. No
    # estimate until smaller steps are recorded; the first one then is right.
    step_time = prefill_law

    job = SyntheticJob([100] * 8, [300] * 8, step_time=step_time)
    estimate = None
    while estimate is None:
        job.step()
        estimate = job.eta.estimate(job.scheduler, [])
    assert len(job.eta.steps) > MIN_STEPS and small_steps(job) >= MIN_SMALL_STEPS
    assert abs(estimate.seconds_left / job.time_to_finish() - 1) < 0.15


def test_the_first_estimate_comes_with_the_first_small_steps_not_at_the_next_timer():
    # A simulation while the record holds full prefill chunks alone gives no estimate; the next one came at the
    # timer (a quarter of the run so far, >= 2 % of the run per simulation's cost), 5 s into a 56 s run of the
    # sample at bf16. It now comes as soon as the record can price the small steps.
    job = SyntheticJob([100] * 8, [300] * 8, step_time=prefill_law)
    while len(job.eta.steps) < MIN_STEPS:
        job.step()
    assert job.eta.estimate(job.scheduler, []) is None
    job.eta._next_simulation = float("inf")   # a timer that would wait for ever
    while small_steps(job) < MIN_SMALL_STEPS:
        assert job.eta.estimate(job.scheduler, []) is None
        job.step()
    estimate = job.eta.estimate(job.scheduler, [])
    assert estimate is not None and abs(estimate.seconds_left / job.time_to_finish() - 1) < 0.15


def test_a_job_of_full_prefill_chunks_alone_is_priced_from_them():
    # one output token a row: every step is a full chunk, so those are the only steps to price
    job = SyntheticJob([1] * 8, [600] * 8)
    while len(job.eta.steps) < MIN_STEPS:
        job.step()
    estimate = job.eta.estimate(job.scheduler, [])
    assert estimate is not None and abs(estimate.seconds_left / job.time_to_finish() - 1) < 0.05


def test_the_estimator_asks_for_decode_steps_and_its_first_estimate_comes_sooner():
    # Long prompts first: small steps come only once every seat decodes, at the 20th step. The estimator asks for
    # steps of decodes alone at its record's 4th step, and its first estimate comes at the record's 8th, as right.
    def first_estimate(job: SyntheticJob) -> tuple[float, int, float]:
        start, estimate = job.clock.t, None
        while estimate is None:
            job.step()
            estimate = job.eta.estimate(job.scheduler, [])
        seconds, small = job.clock.t - start, small_steps(job)
        return seconds, small, estimate.seconds_left / job.time_to_finish() - 1

    waited, _, _ = first_estimate(SyntheticJob([100] * 8, [300] * 8, step_time=prefill_law))
    asked = SyntheticJob([100] * 8, [300] * 8, step_time=prefill_law, decodes_on_request=True)
    sooner, small, error = first_estimate(asked)
    assert small >= MIN_SMALL_STEPS and sooner < 0.6 * waited and abs(error) < 0.15, (sooner, waited, error)
