"""The step time split of an engine run: forward, sampler, scheduler (and the rest of the step, by difference)."""
from __future__ import annotations


class StepSplit:
    """Sums the phases of the engine's steps (waiting for the device at each phase boundary, so a forward's time is
    not billed to the sampler that waits for it), from the engine's own step reports. A context manager."""

    def __init__(self, engine):
        self.seconds = {"forward": 0.0, "sampler": 0.0, "scheduler": 0.0}
        self.engine = engine
        self._stop = None

    def __enter__(self) -> "StepSplit":
        self._stop = self.engine.observe(self._add, synchronize=True)
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _add(self, stats) -> None:
        self.seconds["forward"] += stats.forward_s
        self.seconds["sampler"] += stats.sample_s
        self.seconds["scheduler"] += stats.schedule_s + stats.update_s

    def shares(self, total: float) -> dict:
        # 6 places: a part of a few hundred microseconds in a loaded step must not round to 0
        parts = {k: round(v / total, 6) for k, v in self.seconds.items()}
        return parts | {"rest": round(1 - sum(parts.values()), 6), "step_s_total": round(total, 3)}
