"""A deadline as people write it, one grammar for the job file's `deadline:` and `batchrun plan --deadline`:
a duration from now ("6h", "90m", "1h30m", "2d", "45s"), a clock time ("07:00": the next one, local time) or a
date-time ("2030-01-31T06:00", with or without a zone; YAML's own timestamps too)."""
from __future__ import annotations

import re
from datetime import datetime, timedelta

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\s*\d+(?:\.\d+)?\s*[smhd])+\s*")
FORMS = 'a duration (6h, 90m, 1h30m, 2d), a clock time ("07:00", the next one) or a date-time (2030-01-31T06:00)'


def parse_deadline(value, now: datetime | None = None) -> datetime:
    """The deadline as a local datetime. ValueError (without a field name: the caller adds where it came from)
    for text none of the forms reads, or a duration that is not positive."""
    now = now or datetime.now()
    if isinstance(value, datetime):
        at = value
    else:
        text = str(value).strip()
        lowered = text.lower()
        if _DURATION.fullmatch(lowered):
            seconds = sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)\s*([smhd])", lowered))
            if seconds <= 0:
                raise ValueError(f"must be a positive duration, got {text!r}")
            return now + timedelta(seconds=seconds)
        try:
            if len(text) <= 8 and ":" in text:
                clock = datetime.strptime(text, "%H:%M:%S" if text.count(":") == 2 else "%H:%M").time()
                at = datetime.combine(now.date(), clock)
                return at if at > now else at + timedelta(days=1)
            at = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"cannot read {text!r} as a deadline; give {FORMS}") from None
    return at.astimezone().replace(tzinfo=None) if at.tzinfo else at


def seconds_until(value, now: datetime | None = None) -> float:
    """Seconds from now to the deadline; ValueError when it has passed."""
    now = now or datetime.now()
    seconds = (parse_deadline(value, now) - now).total_seconds()
    if seconds <= 0:
        shown = value.isoformat(timespec="minutes") if isinstance(value, datetime) else str(value)
        raise ValueError(f"{shown!r} is in the past; give a future date-time or a duration")
    return seconds
