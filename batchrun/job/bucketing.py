"""Length bucketing: rows are read in windows and, inside a window, admitted in prompt-length order.

Requests admitted together then have similar lengths, so prefill chunks and decode attention groups are
even. Shortest first by default; longest_first leaves the short requests for the tail. Only a window's
token ids are in memory; a window as large as the input sorts the whole input.

The first window starts with a pilot: a share of each prompt-length class's rows (at least 4), so
that the time left (eta.py) sees early how far each class's outputs run. Without it, a short question that stops
after 10 of its 200 max_tokens is priced, until the sorted order reaches the questions, as the long rows that ran
before it; with too few, a class that mixes such questions with rows cut by a small max_tokens is priced from a
handful of draws of that mix.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from batchrun.admission_order import window_order

if TYPE_CHECKING:
    from batchrun.job.source import Row


class RowFeed:
    def __init__(self, batches: Iterable[list[Row]], prepare: Callable[[list[Row]], None], window: int,
                 bucketing: bool, skip: set[int], longest_first: bool = False,
                 observe: Callable[[list[Row]], None] = lambda rows: None, pilot: float = 0.0):
        self._batches: Iterator[list[Row]] = iter(batches)
        self.prepare, self.window, self.bucketing, self.skip = prepare, window, bucketing, skip
        self.observe = observe   # sees every batch of rows read, once prepared (the ETA's prompt lengths)
        self.longest_first = longest_first
        self.pilot = pilot   # share of each prompt-length class at the head of the first window (bucketing only)
        self.queue: deque[tuple[tuple, Row]] = deque()   # (order_key, row), in admission order
        self.failed: list[Row] = []                     # rows that failed before the engine: write them as they are
        self.window_index = 0
        self.exhausted = False

    def next(self) -> tuple[tuple, Row] | None:
        """The next row to admit and its order key, or None when the input is used up."""
        while not self.queue and not self.exhausted:
            self._fill()
        return self.queue.popleft() if self.queue else None

    @property
    def queued(self) -> Iterator[Row]:
        """Rows read and prepared, not yet handed out."""
        return (row for _, row in self.queue)

    def _fill(self) -> None:
        rows: list[Row] = []
        while len(rows) < self.window:
            batch = next(self._batches, None)
            if batch is None:
                self.exhausted = True
                break
            batch = [r for r in batch if r.index not in self.skip]
            self.prepare(batch)
            self.observe(batch)
            for row in batch:
                (self.failed if row.error else rows).append(row)
        if self.bucketing:
            order = window_order([len(row.token_ids) for row in rows], self.longest_first,
                                 self.pilot if self.window_index == 0 else 0.0)
            self.queue.extend(((self.window_index, rank), rows[i]) for rank, i in enumerate(order))
        else:
            self.queue.extend(((), row) for row in rows)
        self.window_index += 1
