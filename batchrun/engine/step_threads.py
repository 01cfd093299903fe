"""Threads per step while the engine serves: small steps on one thread.

Behind `batchrun serve` the engine steps in its own thread while the HTTP event loop wakes for every streamed token.
With every core in the step's OpenMP team, that wake-up displaces a team thread, and the others spin at the next
barrier until it returns. That is the cost README's "Other work on the machine" measures, caused by the server's
own thread. Small steps lose the most: `vllm bench serve`, SmolLM2 bf16, 256-token prompts and 64 tokens at
1 request/s, on this project's 2-core Xeon gave a TPOT p50 of 56.5 ms on two threads and 35.2 ms on one thread
(vLLM 32.1). At an unlimited rate, where steps are large, two threads made 298.5 output tok/s and one thread 235.9.
Steps of at most SMALL_STEP_TOKENS tokens on one thread, larger ones on all of them: 36.1-36.4 ms and 294.0-298.1
tok/s (thresholds 8 and 16). An offline job keeps every thread (a quiet two-thread step of 7 sequences ran 50.6 ms,
one thread 76.5: nothing competes there).
"""
from __future__ import annotations

import torch

SMALL_STEP_TOKENS = 16


class StepThreads:
    """Sets torch's thread count before each step by the step's size; `restore()` puts the full count back."""

    def __init__(self, small_step_tokens: int = SMALL_STEP_TOKENS):
        self.full = self.current = torch.get_num_threads()
        self.small_step_tokens = small_step_tokens

    def before_step(self, tokens: int) -> None:
        wanted = 1 if tokens <= self.small_step_tokens else self.full
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted

    def warm_up(self, engine) -> None:
        """Build the whole-model graph for one thread too, once per engine: torch.compile's guards include the
        thread count, so the first small step would build it instead (about 6 s of a served request's time, SmolLM2
        bf16 on a 2-core Intel Xeon). The warm-up's prefill steps run on every thread, its decodes on one."""
        if getattr(engine.model, "graph_compiled", False) and not engine.one_thread_warm:
            engine.warm_up()
            engine.one_thread_warm = True

    def restore(self) -> None:
        self.before_step(self.small_step_tokens + 1)
