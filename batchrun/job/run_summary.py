"""This run's part of summary.json, one shape for both executors: its speed and KV figures, its time-left estimate,
and its status. The totals over all runs (rows ok, failed, remaining, tokens) come from the shards (report.counts)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="seconds")


@dataclass
class Estimate:
    """When the job will finish, as summary.json, metrics.prom and `batchrun status` show it (None: not known)."""
    eta_seconds: float | None = None
    predicted_finish: str | None = None
    predicted_finish_timestamp: float | None = None
    expected_output_tokens_left: int | None = None
    deadline: str | None = None
    on_track: bool | None = None

    @classmethod
    def of(cls, seconds_left: float | None, finish_at: float | None, tokens_left: int | None,
           deadline: datetime | None, on_track: bool | None) -> "Estimate":
        return cls(None if seconds_left is None else round(seconds_left, 1),
                   None if finish_at is None else _iso(finish_at),
                   None if finish_at is None else round(finish_at, 1), tokens_left,
                   None if deadline is None else deadline.astimezone().isoformat(timespec="minutes"), on_track)

    @classmethod
    def at_end(cls, now: float, deadline: datetime | None, stopped: bool) -> "Estimate":
        """A run that ended: done now (on track if by the deadline), or stopped (nothing known)."""
        if stopped:
            return cls.of(None, None, None, deadline, None)
        return cls.of(0.0, now, None, deadline, None if deadline is None else now <= deadline.timestamp())


@dataclass
class RunSummary:
    status: str = "running"             # running | done | interrupted
    exit_code: int | None = None        # set when the run ends
    rows_this_run: int = 0
    wall_s: float = 0.0
    output_tokens_this_run: int = 0
    output_tokens_per_s: float = 0.0
    preemptions: int = 0
    kv_blocks_peak: int = 0
    estimate: Estimate = field(default_factory=Estimate)
    details: dict = field(default_factory=dict)   # the executor's own figures (the local engine's pool, Ray's replicas)

    def as_dict(self) -> dict:
        figures = asdict(self)
        estimate, details = figures.pop("estimate"), figures.pop("details")
        return {**figures, **details, **estimate}
