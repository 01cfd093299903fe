"""The job's time left against the output lengths it simulates: each simulated request's length drawn at its own
quantile (eta.antithetic_strata), read by its prompt length."""
import random
import statistics

from batchrun.job.output_lengths import OutputLengths
from test_eta import SyntheticJob


def test_the_simulated_drain_lasts_as_long_as_the_longest_outputs_left(monkeypatch):
    """Most rows stop after 4 tokens, one in seven runs 80: a job ends on a few long rows decoding alone. Every
    simulated request at its expected length (about 15 tokens) stops with the others, and the estimate misses that
    drain; each drawn at its own quantile (eta.antithetic_strata), the simulations have long ones too. Which rows
    turn out long is luck no estimate knows, so the median error over eight such jobs is what is checked."""
    errors = {False: [], True: []}
    for seed in range(8):
        rng = random.Random(seed)
        outputs = [80 if rng.random() < 1 / 7 else 4 for _ in range(300)]
        for drawn in (False, True):
            if not drawn:   # every request at its expected length, as before
                monkeypatch.setattr(OutputLengths, "draw", lambda self, g, m, p, u: self.expected(g, m, p))
            job = SyntheticJob(outputs, [6 + i % 9 for i in range(300)], max_tokens=[200] * 300)
            job.run_until(150)
            errors[drawn].append(job.eta.estimate(job.scheduler, []).seconds_left / job.time_to_finish() - 1)
            monkeypatch.undo()
    assert abs(statistics.median(errors[True])) < 0.03 and statistics.median(errors[False]) < -0.06, errors


def test_a_running_requests_length_is_read_by_its_prompt_length(monkeypatch):
    """Its token ids hold what it generated too: read by their count, a request would take a longer prompt's lengths."""
    job = SyntheticJob([4, 30] * 10, [6 + i % 9 for i in range(20)], max_tokens=[200] * 20)
    job.run_until(4)
    read, draw = [], OutputLengths.draw
    monkeypatch.setattr(OutputLengths, "draw", lambda self, g, m, p, u: read.append((g, p)) or draw(self, g, m, p, u))
    assert job.eta.estimate(job.scheduler, []) is not None
    running = {(len(r.output_token_ids), r.num_prompt_tokens) for r in job.scheduler.running}
    assert any(g > 0 for g, _ in running) and running <= set(read)
    assert all(6 <= p <= 14 for _, p in read)
