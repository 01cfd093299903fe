"""Threads per step while the engine serves: small steps on the thread count measured faster on this machine.

Behind `batchrun serve` the engine steps in its own thread while the HTTP event loop wakes for every streamed token.
With every core in the step's OpenMP team, that wake-up displaces a team thread, and the others spin at the next
barrier until it returns. Whether that costs a small step more than giving up the other cores depends on the CPU:
`vllm bench serve`, SmolLM2 bf16, 256-token prompts and 64 tokens at 1 request/s (vLLM 32.1 and 26.7 ms):
- 2-core Intel Xeon: TPOT p50 56.5 ms on two threads, 35.2 ms on one;
- 2-core AMD EPYC: 29.0 and 28.5 ms on two threads, 32.4 and 40.3 ms on one.
So steps of at most SMALL_STEP_TOKENS tokens run on whichever of one thread and all threads their own step times
say is faster (a running mean per choice; every EXPLORE_EVERY-th small step tries the other, so that a change in
the load is seen): 29.5 and 29.4 ms on that EPYC. Larger steps run on all threads (at an unlimited rate on the
Xeon, two threads made 298.5 output tok/s, one 235.9). An offline job keeps every thread: nothing competes there.
"""
from __future__ import annotations

import torch

SMALL_STEP_TOKENS = 16
EXPLORE_EVERY = 16   # small steps per try of the choice that is not the faster one
WARM_STEPS = 4       # tries of each choice before the means decide
WEIGHT = 0.25        # of a new step time in its choice's running mean (4 tries of a choice turn a 3x change)


class StepThreads:
    """Sets torch's thread count before each step; `after_step(seconds)` reports the step's time, `restore()`
    puts the full count back."""

    def __init__(self, small_step_tokens: int = SMALL_STEP_TOKENS):
        self.full = self.current = torch.get_num_threads()
        self.small_step_tokens = small_step_tokens
        self._forget_times()
        self.timing: int | None = None   # the thread count of the small step whose time comes next
        self.forced: int | None = None   # a thread count for every small step (the warm-up's)

    def _forget_times(self) -> None:
        self.mean = {1: 0.0, self.full: 0.0}   # seconds per small step, per thread count
        self.seen = {1: 0, self.full: 0}
        self.small_steps = 0

    def choice(self) -> int:
        """The thread count for the next small step."""
        self.small_steps += 1
        one, full = self.seen[1], self.seen[self.full]
        if min(one, full) < WARM_STEPS:
            return 1 if one <= full else self.full
        faster = 1 if self.mean[1] <= self.mean[self.full] else self.full
        slower = self.full if faster == 1 else 1
        return slower if self.small_steps % EXPLORE_EVERY == 0 else faster

    def before_step(self, tokens: int) -> None:
        small = 0 < tokens <= self.small_step_tokens
        wanted = (self.forced or self.choice()) if small else self.full
        self.timing = wanted if small else None
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted

    def after_step(self, seconds: float) -> None:
        if self.timing is None:
            return
        n = self.timing
        self.mean[n] = seconds if self.seen[n] == 0 else (1 - WEIGHT) * self.mean[n] + WEIGHT * seconds
        self.seen[n] += 1
        self.timing = None

    def warm_up(self, engine) -> None:
        """Build the whole-model graph for one thread too, once per engine: torch.compile's guards include the
        thread count, so the first small step would build it instead (about 6 s of a served request's time, SmolLM2
        bf16 on a 2-core Intel Xeon). The warm-up's prefill steps run on every thread, its decodes on one."""
        if getattr(engine.model, "graph_compiled", False) and not engine.one_thread_warm:
            self.forced = 1
            try:
                engine.warm_up()
            finally:
                self.forced = None
            self._forget_times()   # compiling is no step's measure
            engine.one_thread_warm = True

    def restore(self) -> None:
        if self.current != self.full:
            torch.set_num_threads(self.full)
            self.current = self.full
        self.timing = None
