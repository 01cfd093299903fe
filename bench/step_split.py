"""Where an engine's step time goes: dense layers, attention, sampler, scheduling, other (Python between them).

    with StepSplit(llm.engine) as split:
        llm.generate(...)
    split.shares(wall_seconds) -> {"dense": 0.61, "attention": 0.25, ...}

The sampler's and the scheduler's times come from the engine's own step reports (Engine.observe); the model's
forward and its attention backend are timed by wrapping them for the duration of the block (a few microseconds per
call); "dense" is the forward less attention.
"""
import time
from collections import defaultdict


class StepSplit:
    def __init__(self, engine):
        self.engine = engine
        self.seconds = defaultdict(float)
        self._restore = []

    def _wrap(self, owner, attr: str, key: str) -> None:
        original, own = getattr(owner, attr), attr in vars(owner)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
        setattr(owner, attr, timed)
        self._restore.append((owner, attr, original if own else None))

    def __enter__(self):
        engine = self.engine
        self._wrap(engine.model, "forward", "forward")
        self._wrap(engine.model.model.layers[0].self_attn.backend, "forward", "attention")
        self._stop_observing = engine.observe(self._add_step)
        return self

    def _add_step(self, stats) -> None:
        self.seconds["sampler"] += stats.sample_s
        self.seconds["scheduling"] += stats.schedule_s + stats.update_s

    def __exit__(self, *exc):
        self._stop_observing()
        for owner, attr, original in reversed(self._restore):
            if original is None:
                delattr(owner, attr)   # back to the class's method
            else:
                setattr(owner, attr, original)
        self._restore.clear()

    def shares(self, wall: float) -> dict[str, float]:
        s = self.seconds
        parts = {"dense": s["forward"] - s["attention"], "attention": s["attention"], "sampler": s["sampler"],
                 "scheduling": s["scheduling"]}
        parts["other"] = wall - sum(parts.values())
        return {k: v / wall for k, v in parts.items()}
