"""Length bucketing: rows are read in windows and, inside a window, admitted in prompt-length order.

Requests admitted together then have similar lengths, so prefill chunks and decode attention groups are
even. Shortest first by default; longest_first leaves the short requests for the tail. Only a window's
token ids are in memory; a window as large as the input sorts the whole input.

The first window starts with a pilot: a few rows of each prompt-length class, so that the time left (eta.py) sees
early how far each class's outputs run. Without it, a short question that stops after 10 of its 200 max_tokens
is priced, until the sorted order reaches the questions, as the long rows that ran before it.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

if TYPE_CHECKING:
    from batchrun.job.source import Row


def length_class(prompt_tokens: int) -> int:
    """The prompt-length class of a row: powers of two."""
    return max(prompt_tokens, 1).bit_length()


class RowFeed:
    def __init__(self, batches: Iterable[list[Row]], prepare: Callable[[list[Row]], None], window: int,
                 bucketing: bool, skip: set[int], longest_first: bool = False,
                 observe: Callable[[list[Row]], None] = lambda rows: None, pilot: int = 0):
        self._batches: Iterator[list[Row]] = iter(batches)
        self.prepare, self.window, self.bucketing, self.skip = prepare, window, bucketing, skip
        self.observe = observe   # sees every batch of rows read, once prepared (the ETA's prompt lengths)
        self.longest_first = longest_first
        self.pilot = pilot   # rows per prompt-length class at the head of the first window (bucketing only)
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
            rows.sort(key=lambda r: len(r.token_ids), reverse=self.longest_first)
            if self.window_index == 0 and self.pilot:
                rows = self._pilot_first(rows)
            self.queue.extend(((self.window_index, rank), row) for rank, row in enumerate(rows))
        else:
            self.queue.extend(((), row) for row in rows)
        self.window_index += 1

    def _pilot_first(self, rows: list[Row]) -> list[Row]:
        """rows (sorted) with up to `pilot` rows of each length class, spread over the class, moved to the head."""
        classes: dict[int, list[int]] = {}
        for position, row in enumerate(rows):
            classes.setdefault(length_class(len(row.token_ids)), []).append(position)
        head = set()
        for positions in classes.values():
            step = len(positions) / min(self.pilot, len(positions))
            head.update(positions[int(k * step)] for k in range(min(self.pilot, len(positions))))
        return [rows[i] for i in sorted(head)] + [row for i, row in enumerate(rows) if i not in head]
