"""The time left as people read it: durations and clock times on the progress line, and the deadline verdict from
the estimate's band (job/eta.py makes the estimate)."""
from __future__ import annotations

from datetime import datetime

from batchrun.job.eta import Eta


def clock_text(at: datetime, now: datetime) -> str:
    return at.strftime("%H:%M" if at.date() == now.date() else "%a %H:%M")


def duration_text(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    minutes = round(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}" if minutes >= 60 else f"{minutes} min"


def deadline_verdict(eta: Eta, deadline: datetime, job_path: str) -> tuple[str, str]:
    """("on track" | "at risk" | "late", a line for the log): on track when even the band's late end (p90) is by
    the deadline, late when even its early end (p10) is past it, at risk between."""
    now = datetime.now()
    predicted = datetime.fromtimestamp(eta.finish_at)
    early = datetime.fromtimestamp(eta.finish_at - eta.seconds_left + (eta.low if eta.low is not None
                                                                       else eta.seconds_left))
    late_end = datetime.fromtimestamp(eta.finish_at - eta.seconds_left + (eta.high if eta.high is not None
                                                                          else eta.seconds_left))
    plan = (f"`batchrun plan {job_path} --deadline {deadline.isoformat(timespec='minutes')}` suggests the GPUs that "
            f"finish in time")
    if late_end <= deadline:
        return "on track", f"on track: predicted {clock_text(predicted, now)}, deadline {clock_text(deadline, now)}"
    if early > deadline:
        late = (predicted - deadline).total_seconds()
        return "late", f"late by ~{duration_text(late)} at this rate (deadline {clock_text(deadline, now)}): {plan}"
    return "at risk", (f"at risk: predicted {clock_text(predicted, now)} (p90 {clock_text(late_end, now)}), "
                       f"deadline {clock_text(deadline, now)}: {plan}")
