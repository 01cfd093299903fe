"""Serving on the CPU: small steps on one thread, larger ones on all (engine/step_threads.py)."""
import pytest
import torch

from batchrun import SamplingParams
from batchrun.engine.step_threads import SMALL_STEP_TOKENS, StepThreads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_small_steps_run_on_one_thread(two_threads):
    threads = StepThreads()
    threads.before_step(SMALL_STEP_TOKENS)
    assert torch.get_num_threads() == 1
    threads.before_step(SMALL_STEP_TOKENS + 1)
    assert torch.get_num_threads() == 2
    threads.before_step(3)
    threads.restore()
    assert torch.get_num_threads() == 2


def test_the_background_loop_sets_threads_per_step_and_gives_them_back(tiny_llm, two_threads):
    seen = []
    stop_observing = tiny_llm.engine.observe(lambda stats: seen.append((stats.shape.tokens, torch.get_num_threads())))
    tiny_llm.start_background()
    try:
        assert tiny_llm.engine.step_threads is not None
        prompts = [[5, 6, 7] * 10, [8, 9]]   # a 30-token prefill step, then decode steps of two tokens
        handles = [tiny_llm.submit(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)) for p in prompts]
        for handle in handles:
            handle.result(timeout=30)
    finally:
        tiny_llm.stop_background()
        stop_observing()
    assert tiny_llm.engine.step_threads is None and torch.get_num_threads() == 2
    assert any(t > SMALL_STEP_TOKENS and n == 2 for t, n in seen)
    assert any(0 < t <= SMALL_STEP_TOKENS and n == 1 for t, n in seen)
