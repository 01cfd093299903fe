"""The step time split of an engine run: forward, sampler, scheduler (and the rest of the step, by difference)."""
from __future__ import annotations

import time

import torch


class StepSplit:
    """Wraps the engine's forward, sampler and scheduler calls with timers (synchronising the device first, so a
    forward's time is not billed to the sampler that waits for it)."""

    def __init__(self, engine):
        self.seconds = {"forward": 0.0, "sampler": 0.0, "scheduler": 0.0}
        self.device = engine.device
        engine.runner.run = self._timed("forward", engine.runner.run)
        engine.sampler = self._timed("sampler", engine.sampler)
        engine.scheduler.schedule = self._timed("scheduler", engine.scheduler.schedule)
        engine.scheduler.update = self._timed("scheduler", engine.scheduler.update)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, part: str, fn):
        def call(*args, **kwargs):
            self._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.seconds[part] += time.perf_counter() - start
        return call

    def shares(self, total: float) -> dict:
        # 6 places: a part of a few hundred microseconds in a loaded step must not round to 0
        parts = {k: round(v / total, 6) for k, v in self.seconds.items()}
        return parts | {"rest": round(1 - sum(parts.values()), 6), "step_s_total": round(total, 3)}
