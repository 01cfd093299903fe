"""The engine's start-up warm-up: the whole-model graph built before the first real step.

Built at the first step, that step took 4.9 s (the process's second engine) to 16 s (its first) of a 69 s bf16
SmolLM2 job on an Intel Xeon, counted as stepping by the job's step record, its ETA (whose first estimate then came
after 10 % of the run) and calibration.
"""
from __future__ import annotations

import logging
import time

from batchrun.sampling_params import SamplingParams

log = logging.getLogger("batchrun")


def warm_up(engine) -> None:
    """Two short requests, one of them after a cached prefix, through prefill and decode (the engine then forgets
    their ids, steps and cache hits)."""
    started = time.perf_counter()
    vocab = engine.hf_config.vocab_size
    prefix = [(10 + i) % vocab for i in range(2 * engine.config.block_size)]
    for prompt in (prefix + [5 % vocab, 6 % vocab], prefix + [7 % vocab]):
        engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0))
        while engine.has_unfinished():
            engine.step()
    log.info("forward graph compiled in %.1f s", time.perf_counter() - started)
