"""The order a bucketed job admits the rows of a window in, shared by the job's feed (job/bucketing.py) and the
planner's simulation of the job (planner/simulate.py)."""
from __future__ import annotations

import math


def length_class(prompt_tokens: int) -> int:
    """The prompt-length class of a row: powers of two."""
    return max(prompt_tokens, 1).bit_length()


PILOT_MIN_ROWS = 4   # the least a class puts in the pilot: the finished rows the time left needs for its own lengths


def window_order(prompt_lengths: list[int], longest_first: bool, pilot: float) -> list[int]:
    """A bucketed window's admission order (positions in the window): by prompt length, after a `pilot` share of
    each length class (at least PILOT_MIN_ROWS), spread over the class. The pilot runs shortest first in either
    order: it is there for the time left to read each class's output lengths, and short prompts finish soonest.
    Longest first, a pilot in the job's order finished 2 rows, all of the longest class, by 5 % of a 1,000-row
    job and put its output tokens left +25 % (the classes without rows read as the long ones, run to max_tokens);
    shortest first, 57 rows of three classes and -5 % (its rows replayed through the scheduler, steps priced by
    the run's own fit: the same makespan within 0.1 %)."""
    order = sorted(range(len(prompt_lengths)), key=prompt_lengths.__getitem__, reverse=longest_first)
    if not pilot:
        return order
    classes: dict[int, list[int]] = {}
    for rank, position in enumerate(order):
        classes.setdefault(length_class(prompt_lengths[position]), []).append(rank)
    head = set()
    for ranks in classes.values():
        count = min(len(ranks), max(PILOT_MIN_ROWS, math.ceil(pilot * len(ranks))))
        step = len(ranks) / count
        head.update(ranks[int(k * step)] for k in range(count))
    pilot_rows = sorted((order[r] for r in sorted(head)), key=prompt_lengths.__getitem__)
    return pilot_rows + [position for r, position in enumerate(order) if r not in head]
