"""Context that sequences of one step share (a prefix cached once, read once): counted apart in the step's shape,
kept in the simulation of the running requests, and priced apart by the step fit, so that a job whose tail runs
prompts beside their copies is not priced as if each read its own (README: shared context priced apart)."""
import dataclasses
from types import SimpleNamespace

import pytest

import batchrun.stepmodel.simulate as simulate_module
from batchrun.engine.request import Request
from batchrun.engine.step_stats import StepShape
from batchrun.job.eta import EtaEstimator
from batchrun.sampling_params import SamplingParams
from batchrun.stepmodel.linear_fit import fit_linear
from batchrun.stepmodel.simulate import WorkItem, fake_forward, make_scheduler, simulate
from test_eta import POOL, SyntheticJob


def request(blocks: list[int], context: int, lane: str = "batch") -> SimpleNamespace:
    return SimpleNamespace(num_computed_tokens=context - 1, block_table=blocks, lane=lane)


def test_a_step_counts_the_context_in_blocks_an_earlier_sequence_reads():
    # blocks of 4 tokens: the second request reads blocks 0-1 (8 tokens) the first reads, and its own block 5
    first, second = request([0, 1, 2], 11), request([0, 1, 5], 10)
    shape = StepShape.of([(first, 1), (second, 1)], block_size=4)
    assert (shape.kv_tokens, shape.shared_kv_tokens, shape.unique_kv_tokens) == (21, 8, 13)
    # each lane's pool numbers its own blocks: the same number in another lane is another block
    assert StepShape.of([(first, 1), (request([0, 1, 5], 10, "interactive"), 1)], block_size=4).shared_kv_tokens == 0
    assert StepShape.of([(first, 1), (second, 1)]).shared_kv_tokens == 0   # no block size: not counted


def copies(count: int, length: int, seed: int) -> list[list[int]]:
    return [[2 + (seed * 31 + j) % 900 for j in range(length)] for _ in range(count)]


def test_the_simulation_shares_the_running_requests_prompts_as_the_engine_did():
    # four copies of a 32-token prompt and two prompts of their own, 9 tokens generated each: the copies share 7
    # blocks of their prompt (the cache serves all but its last token); their outputs, the same tokens, stay private
    num_blocks, block_size = 200, 4
    scheduler = make_scheduler(num_blocks, block_size, 8, 256, prefix_caching=True)
    prompts = copies(4, 32, 1) + copies(1, 32, 2) + copies(1, 20, 3)
    for i, ids in enumerate(prompts):
        scheduler.add(Request(str(i), ids, SamplingParams(max_tokens=40, temperature=0), arrival_index=i))
    while min((len(r.output_token_ids) for r in scheduler.running), default=0) < 9:
        fake_forward(scheduler, scheduler.schedule())
    items = [WorkItem(tuple(r.token_ids), r.params.max_tokens - len(r.output_token_ids), r.num_computed_tokens,
                      len(r.output_token_ids)) for r in scheduler.running]
    engine_step = StepShape.of(scheduler.schedule().scheduled, block_size)
    simulated = simulate(items, num_blocks, block_size, 8, 256, prefix_caching=True).shapes[0]
    assert engine_step.shared_kv_tokens == 3 * 28
    assert simulated == engine_step


def shared_law(shape: StepShape) -> float:
    """A machine where a shared context token costs 0.6 of a private one's."""
    return 0.005 + 1e-4 * shape.tokens + 1e-4 * shape.unique_kv_tokens + 6e-5 * shape.shared_kv_tokens


def tail_of_copies() -> tuple[list[int], list]:
    """(outputs, prompts): 24 rows of 40-token prompts, two copies of each, then 24 of 120 tokens, four copies of
    each, as a shortest-first job whose long prompts repeat: the shared share of the context grows over the run."""
    prompts = [p for k in range(12) for p in copies(2, 40, k)] + [p for k in range(6) for p in copies(4, 120, 50 + k)]
    return [30] * len(prompts), prompts


def test_the_fit_recovers_the_shared_context_term_one_context_term_misprices():
    outputs, prompts = tail_of_copies()
    job = SyntheticJob(outputs, prompts, step_time=shared_law, prefix_caching=True)
    job.time_to_finish()
    shapes, times = job.eta.recorded()
    model = fit_linear(shapes, times, holdout_every=0)
    assert (model.a, model.b, model.c, model.cs) == pytest.approx((0.005, 1e-4, 1e-4, 6e-5), rel=1e-6)
    # fitted on the first half (its shared share 33-38 %, the tail's 63-65 %), priced on the second
    half = len(shapes) // 2
    new = fit_linear(shapes[:half], times[:half], holdout_every=0)
    assert sum(new.step_time(s) for s in shapes[half:]) / sum(times[half:]) == pytest.approx(1, abs=0.02)
    one_term = [dataclasses.replace(s, shared_kv_tokens=0) for s in shapes]
    old = fit_linear(one_term[:half], times[:half], holdout_every=0)
    assert sum(old.step_time(s) for s in one_term[half:]) / sum(times[half:]) > 1.2


class OneContextTerm(StepShape):
    """The step shape before shared context was counted."""

    @classmethod
    def of(cls, scheduled, block_size: int = 0) -> StepShape:
        return StepShape.of(scheduled)


def test_copies_in_the_tail_do_not_fool_the_estimate(monkeypatch):
    outputs, prompts = tail_of_copies()
    ratios = {}
    for counted in (False, True):
        if not counted:
            monkeypatch.setattr(simulate_module, "StepShape", OneContextTerm)
        job = SyntheticJob(outputs, prompts, step_time=shared_law, prefix_caching=True, count_shared=counted)
        job.run_until(24)
        ratios[counted] = job.eta.estimate(job.scheduler, []).seconds_left / job.time_to_finish()
        monkeypatch.undo()
    # at half the rows (1.25 and 1.06 here): one context term prices the copies' tail as if each read its own
    assert ratios[False] > 1.15 and abs(ratios[True] - 1) < 0.1, ratios


def test_steps_saved_before_shared_context_was_counted_resume_as_private():
    # (tokens, seqs, context, pairs, seconds) and the older (tokens, seqs, context, seconds)
    saved = {"steps": [[32, 32, 3000, 3000, 0.05], [64, 1, 64, 0.2]]}
    eta = EtaEstimator(**POOL, rows_to_read=0, window=8192, bucketing=False, longest_first=False, saved=saved)
    assert eta.recorded() == ([StepShape(32, 32, 3000, 3000), StepShape(64, 1, 64, 64)], [0.05, 0.2])
