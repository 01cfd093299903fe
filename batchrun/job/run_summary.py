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
    eta_seconds_p10: float | None = None      # the band around it (eta_band)
    eta_seconds_p90: float | None = None
    predicted_finish: str | None = None
    predicted_finish_timestamp: float | None = None
    expected_output_tokens_left: int | None = None
    deadline: str | None = None
    on_track: bool | None = None              # the point estimate is by the deadline
    deadline_verdict: str | None = None       # on track (the band's p90 is by it) | at risk | late (its p10 is past)

    @classmethod
    def of(cls, eta, deadline: datetime | None, verdict: str | None) -> "Estimate":
        """From an eta.Eta (None: no estimate yet)."""
        shown = _deadline_text(deadline)
        if eta is None:
            return cls(deadline=shown)
        return cls(round(eta.seconds_left, 1), _round(eta.low), _round(eta.high), _iso(eta.finish_at),
                   round(eta.finish_at, 1), eta.output_tokens_left, shown,
                   None if deadline is None else eta.finish_at <= deadline.timestamp(), verdict)

    @classmethod
    def at_end(cls, now: float, deadline: datetime | None, stopped: bool) -> "Estimate":
        """A run that ended: done now (on track if by the deadline), or stopped (nothing known)."""
        shown = _deadline_text(deadline)
        if stopped:
            return cls(deadline=shown)
        on_track = None if deadline is None else now <= deadline.timestamp()
        return cls(0.0, 0.0, 0.0, _iso(now), round(now, 1), None, shown, on_track,
                   None if on_track is None else "on track" if on_track else "late")


def _deadline_text(deadline: datetime | None) -> str | None:
    return None if deadline is None else deadline.astimezone().isoformat(timespec="minutes")


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


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
