"""One request that fails inside the engine's shared step (its sampling, its grammar, its stop rule) ends alone with
its reason; the step goes on for the others, and the engine (and the server in front of it) stays usable."""
from __future__ import annotations

import pytest

from batchrun import LLM, SamplingParams
from conftest import random_prompts

POISON_SEED = 666   # the injected faults below pick out the requests that carry this seed


class _PoisonedSampler:
    """The engine's sampler, raising whenever a request with POISON_SEED is among the rows it is asked to sample:
    a value that passed validation and fails inside the step."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __call__(self, logits, requests):
        if any(r.params.seed == POISON_SEED for r in requests):
            raise OverflowError("injected: this seed breaks the generator")
        return self.sampler(logits, requests)


class _RaisingMatcher:
    def fill_next_token_bitmask(self, bitmask, index):
        raise RuntimeError("injected: matcher state corrupted")


@pytest.fixture
def llm(tiny_model):
    return LLM(model=tiny_model[0], kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=64)


def _greedy(max_tokens=6, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def test_faults_of_single_requests_fail_them_alone_mid_batch(llm):
    prompts = random_prompts([5, 7, 9, 4, 6, 8], seed=3)
    clean = [o.token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]

    llm.engine.sampler = _PoisonedSampler(llm.engine.sampler)
    ids = [llm.add_request(p, _greedy()).request_id for p in prompts]
    for _ in range(2):   # the batch is running (prefilled, decoding) when the faulty requests join
        llm.step()
    poisoned = llm.add_request([3, 4, 5], SamplingParams(max_tokens=6, temperature=0.7, seed=POISON_SEED))
    bad_stop = llm.add_request([6, 7, 8], _greedy(stop=["x"]))
    bad_stop.params.stop = [7]   # past validation, as a bug elsewhere could leave it: the stop rule raises
    structured = llm.add_request([9, 10], _greedy(choice=["yes", "no"]))
    structured.grammar = _RaisingMatcher()

    finals = {}
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                finals[out.request_id] = out
    assert [finals[i].token_ids for i in ids] == clean   # the others are untouched, token for token
    assert {finals[i].finish_reason for i in ids} == {"length"}
    bad = {r.request_id: finals[r.request_id] for r in (poisoned, bad_stop, structured)}
    assert all(o.finish_reason == "error" for o in bad.values())
    assert "sampling failed: OverflowError: injected" in bad[poisoned.request_id].error
    assert "stop rule failed: TypeError" in bad[bad_stop.request_id].error
    assert "grammar matcher failed (injected: matcher state corrupted)" in bad[structured.request_id].error
    # the engine goes on: its pool is whole and a new batch runs as before
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert [o.token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)] == clean


def test_a_fault_in_every_row_is_the_engines_and_propagates(llm):
    llm.engine.sampler = _PoisonedSampler(llm.engine.sampler)
    for p in random_prompts([4, 5], seed=1):
        llm.add_request(p, SamplingParams(max_tokens=3, temperature=0.5, seed=POISON_SEED))
    with pytest.raises(OverflowError, match="injected"):
        while llm.has_unfinished():
            llm.step()


def test_a_grammar_that_dead_ends_fails_its_row_instead_of_an_empty_ok(llm):
    # 'ab' then a character class that matches nothing: satisfiable by no text, found once 'ab' is generated
    outs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=8, regex=r"ab[^\s\S]", temperature=0),
                                              _greedy(3)], use_tqdm=False)
    assert outs[0].finish_reason == "error" and "no text satisfies the constraint" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 3


def test_the_background_loop_survives_a_poisoned_request(llm):
    llm.engine.sampler = _PoisonedSampler(llm.engine.sampler)
    llm.start_background()
    try:
        bad = llm.submit([3, 4, 5], SamplingParams(max_tokens=4, temperature=0.7, seed=POISON_SEED))
        good = [llm.submit(p, _greedy(4)) for p in random_prompts([5, 6], seed=2)]
        assert bad.result(timeout=30).finish_reason == "error"
        assert [h.result(timeout=30).finish_reason for h in good] == ["length", "length"]
        assert llm.healthy
        first = llm.submit([1, 2], _greedy(50), request_id="x")
        with pytest.raises(ValueError, match="request_id: 'x' is already in flight"):
            llm.submit([1, 2], _greedy(2), request_id="x")
        assert first.result(timeout=30).finish_reason == "length"
    finally:
        llm.stop_background()
