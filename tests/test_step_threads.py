"""Serving on the CPU: small steps on the thread count measured faster, larger ones on all (engine/step_threads.py), the graph built for
both at start, and the starting thread's OpenMP workers released (engine/openmp_pool.py)."""
import os
import time

import pytest
import torch

from batchrun import SamplingParams
from batchrun.engine import openmp_pool
from batchrun.engine.step_threads import EXPLORE_EVERY, SMALL_STEP_TOKENS, WARM_STEPS, StepThreads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_small_steps_run_on_the_thread_count_their_times_say_is_faster(two_threads):
    threads = StepThreads()

    def small_steps(count, seconds):   # seconds[n]: what a small step on n threads takes
        used = []
        for _ in range(count):
            threads.before_step(SMALL_STEP_TOKENS)
            used.append(torch.get_num_threads())
            threads.after_step(seconds[used[-1]])
        return used

    assert small_steps(2 * WARM_STEPS, {1: 0.02, 2: 0.01}) == [1, 2] * WARM_STEPS   # each tried in turn
    used = small_steps(4 * EXPLORE_EVERY, {1: 0.02, 2: 0.01})
    assert used.count(1) == 4 and used.count(2) == 4 * EXPLORE_EVERY - 4   # the other one now and then, no more
    threads.before_step(SMALL_STEP_TOKENS + 1)   # a large step: every thread, and its time is not a small step's
    assert torch.get_num_threads() == 2
    threads.after_step(5.0)
    used = small_steps(6 * EXPLORE_EVERY, {1: 0.005, 2: 0.01})   # the load changed: one thread is faster now
    assert used[-2 * EXPLORE_EVERY:].count(2) == 2   # only the tries of the slower choice
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


def test_serving_builds_the_one_thread_graph_at_start_and_keeps_the_counts(tiny_model, two_threads, monkeypatch):
    """The background loop first builds the graph for one thread (torch.compile guards on the thread count), so a
    served request's small steps compile nothing; the warm-up leaves no steps, ids or observed steps behind."""
    from torch._dynamo.utils import counters
    from batchrun import LLM
    monkeypatch.setenv("BATCHRUN_COMPILE", "1")   # the whole-model graph (the CPU default; conftest turns it off)
    llm = LLM(model=tiny_model[0], kv_cache_memory="4MiB", block_size=4)
    seen = []
    stop_observing = llm.engine.observe(lambda stats: seen.append(stats.step))
    llm.start_background()
    try:
        deadline = time.monotonic() + 120
        while not llm.engine.one_thread_warm and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llm.engine.one_thread_warm
        graphs = counters["stats"]["unique_graphs"]
        out = llm.submit([5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)).result(timeout=60)
        assert counters["stats"]["unique_graphs"] == graphs, "a served step compiled the graph again"
    finally:
        llm.stop_background()
        stop_observing()
    assert out.request_id == "submit-0" and len(out.token_ids) == 3
    assert llm.engine.stats.step == len(seen) == 3   # a prefill step and two decodes: the request's alone


def test_releasing_the_openmp_pool_frees_its_workers(two_threads):
    """After a parallel region on two threads the calling thread keeps a worker; release_thread_pool ends it, and
    the next region builds a new pool."""
    if openmp_pool._libgomp() is None:
        pytest.skip("this process's OpenMP runtime is not libgomp")
    x = torch.ones(1 << 22)
    x.add_(1)
    before = len(os.listdir("/proc/self/task"))
    assert openmp_pool.release_thread_pool()
    assert len(os.listdir("/proc/self/task")) < before
    assert float(x.add_(1).sum()) == 3 * (1 << 22)
