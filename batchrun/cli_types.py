"""The command line's number flags: each checked when the flag is read, so a bad value is a usage error naming it."""
from __future__ import annotations

import click


class Bounded(click.ParamType):
    """A number in a range, checked when the flag is read (NaN and inf refused), so a bad flag is a usage error
    naming it (exit 2), never a traceback from deep inside a command."""

    def __init__(self, kind: type, low: float, high: float | None = None, low_open: bool = False):
        self.kind, self.low, self.high, self.low_open = kind, low, high, low_open
        self.name = kind.__name__
        left = "(" if low_open else "["
        noun = "an integer" if kind is int else "a number"
        self.what = f"{noun} in {left}{low}, {high}]" if high is not None else \
            f"{noun} {'>' if low_open else '>='} {low}"

    def convert(self, value, param, ctx):
        try:
            number = self.kind(value)
        except (TypeError, ValueError):
            self.fail(f"must be {self.what}, got {value!r}", param, ctx)
        above = number > self.low if self.low_open else number >= self.low
        if not (above and (self.high is None or number <= self.high)):   # NaN fails every comparison
            self.fail(f"must be {self.what}, got {value!r}", param, ctx)
        return number


POSITIVE_INT = Bounded(int, 1)
NON_NEGATIVE = Bounded(float, 0)
POSITIVE = Bounded(float, 0, low_open=True)
SHARE = Bounded(float, 0, 1, low_open=True)
PORT = Bounded(int, 0, 65535)
