"""The engine reports each step (shape and phase times) to its observers; no module outside the engine swaps an
engine, scheduler, runner or sampler method to watch a step."""
import os
import re

import batchrun
from batchrun import SamplingParams
from conftest import random_prompts


def test_observers_get_every_steps_shape_and_phases(tiny_llm):
    seen = []
    stop = tiny_llm.engine.observe(lambda s: seen.append((s.step, s.shape, s.step_time, s.schedule_s, s.forward_s,
                                                          s.sample_s, s.update_s)))
    outs = tiny_llm.generate(random_prompts([20, 5]), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                             use_tqdm=False)
    stop()
    tiny_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)   # not observed any more
    cached = sum(o.cached_tokens for o in outs)   # the session's engine may hold these prompts' blocks already
    assert sum(shape.tokens for _, shape, *_ in seen) == 25 - cached + 2 * 3   # prompts, then one token a decode
    assert seen[0][1].seqs == 2 and seen[0][1].kv_tokens == 25 and seen[-1][1].tokens == 2
    assert [step for step, *_ in seen] == list(range(seen[0][0], seen[0][0] + len(seen)))
    for _, _, total, *phases in seen:
        assert all(p >= 0 for p in phases) and abs(sum(phases) - total) < 1e-6
    assert [len(o.token_ids) for o in outs] == [4, 4]


def test_no_module_outside_the_engine_reassigns_its_methods():
    root = os.path.dirname(batchrun.__file__)
    # engine.sampler = ..., engine.scheduler.schedule = ...; not a job-file override in a string ("engine.x=1")
    assignment = re.compile(r"(?<![\"'])\bengine(\.\w+)+\s*=(?!=)")
    found = []
    for directory, _, files in os.walk(root):
        if os.path.basename(directory) == "engine":
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                found += [f"{path}:{i}: {line.strip()}" for i, line in enumerate(open(path), 1)
                          if assignment.search(line)]
    assert found == []
