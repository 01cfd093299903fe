"""Where an engine's step time goes: dense layers, attention, sampler, scheduling, other (Python between them).

    with StepSplit(llm.engine) as split:
        llm.generate(...)
    split.shares(wall_seconds) -> {"dense": 0.61, "attention": 0.25, ...}

Times the model's forward, the attention backend, the sampler and the scheduler by wrapping them for the duration
of the block (a few microseconds per call); "dense" is the forward less attention.
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
        self._wrap(engine, "sampler", "sampler")
        self._wrap(engine.scheduler, "schedule", "scheduling")
        return self

    def __exit__(self, *exc):
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
