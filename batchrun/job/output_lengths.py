"""A row's output length, in tokens, by prompt length: from the rows finished so far, with the running ones and
those cut by max_tokens as lower bounds (Kaplan-Meier), since outputs stop early and short ones finish first."""
from __future__ import annotations

import bisect
from collections import deque

import numpy as np

from batchrun.admission_order import PILOT_MIN_ROWS, length_class

KEEP = 4096               # recent steps and finished lengths kept (and saved for a resumed run)
NEIGHBOURS = 16           # finished rows of a row's class, nearest its prompt length, that its length is read from


class KaplanMeier:
    """The distribution of a row's natural output length (in tokens: where it would stop with no max_tokens) from
    rows that stopped (events) and rows known only to run at least so far (censored: those cut by their
    max_tokens, and those still running). The mass beyond every observation is unbounded: any max_tokens cuts it."""

    def __init__(self, events: list[int], censored: list[int]):
        events, censored = np.sort(np.array(events, dtype=float)), np.sort(np.array(censored, dtype=float))
        values, deaths = np.unique(events, return_counts=True)
        # a row censored at n ran at least n tokens: it is at risk at every length up to n
        at_risk = (len(events) - np.searchsorted(events, values, side="left")
                   + len(censored) - np.searchsorted(censored, values, side="left"))
        survival = np.cumprod(1 - deaths / at_risk)
        self.values = values
        self.mass = -np.diff(np.concatenate([[1.0], survival]))
        self.tail = survival[-1] if len(survival) else 1.0

    def expected(self, generated: int, max_tokens: int) -> float:
        """E[min(length, max_tokens) | length > generated]."""
        above = self.values > generated
        values, mass = self.values[above], self.mass[above]
        total = mass.sum() + self.tail
        if total <= 1e-12:
            return float(max_tokens)
        return float((np.minimum(values, max_tokens) * mass).sum() + max_tokens * self.tail) / total

    def quantile(self, generated: int, max_tokens: int, u: float) -> float:
        """The u-quantile of min(length, max_tokens) given length > generated."""
        above = self.values > generated
        values, mass = self.values[above], self.mass[above]
        total = mass.sum() + self.tail
        if total <= 1e-12:
            return float(max_tokens)
        at = int(np.searchsorted(np.cumsum(mass) / total, u))
        return float(max_tokens) if at == len(values) else float(min(values[at], max_tokens))


class OutputLengths:
    """Output lengths by prompt length (a question and an article to summarise stop at different points, and
    bucketing runs them at different times). Lengths in tokens, not as a share of max_tokens: a row with a large
    max_tokens is most often one that stops early, so a share would price it at what rows cut by a small max_tokens
    did. Finished rows that stopped are observations; rows cut by max_tokens and running rows are censored ones.

    A row is read from the NEIGHBOURS finished rows of its prompt-length class (powers of two) nearest its prompt
    length, once the class has that many: bucketing runs a class in prompt-length order, so the class's finished
    rows are mostly those just shorter (or longer) than the rows left, and prompts a few tokens apart are often
    different tasks (in the sample job, prompts of 34-36 tokens ran to 85-256 output tokens and those of 37-41 stopped
    at 8-110: read as a whole, the class put the 1,000-row bench job's tokens left 11-15 % high at a quarter of the
    run). With fewer, the whole class's rows (with its neighbours' while it has fewer than MIN_EVENTS), and with
    none, all rows."""

    MIN_EVENTS = PILOT_MIN_ROWS   # finished rows of a class (or it and its neighbours) for its own distribution

    def __init__(self, finished: list[tuple[int, int, bool]] = ()):
        # (prompt tokens, tokens generated, cut by max_tokens)
        self.finished: deque[tuple[int, int, bool]] = deque(map(tuple, finished), maxlen=KEEP)
        self._all = KaplanMeier([], [])               # nothing observed yet: every row runs to max_tokens
        self._by_class: dict[int, KaplanMeier] = {}
        self._sorted: list[tuple[int, int, bool]] = []  # the finished rows by prompt length
        self._running: list[tuple[int, int]] = []
        self._nearest: dict[tuple[int, int], KaplanMeier] = {}

    def fit(self, running: list[tuple[int, int]]) -> None:
        """running: (prompt tokens, tokens generated so far) of the rows in the engine."""
        finished = [(length_class(p), n, cut) for p, n, cut in self.finished]
        censored = [(length_class(p), n, True) for p, n in running]
        self._all = _kaplan_meier(finished + censored)
        self._by_class = {}
        for c in {k for k, _, _ in finished}:
            # the class's own rows once there are enough: a neighbour's rows, often all cut by their max_tokens,
            # would count as rows still running at every length below their cut and push the class's lengths up
            for reach in (0, 1):
                near = [row for row in finished if abs(row[0] - c) <= reach]
                if len(near) >= self.MIN_EVENTS:
                    self._by_class[c] = _kaplan_meier(near + [row for row in censored if abs(row[0] - c) <= reach])
                    break
        self._sorted, self._running, self._nearest = sorted(self.finished), sorted(running), {}

    def expected(self, generated: int, max_tokens: int, prompt_tokens: int) -> int:
        """Expected total output tokens of a row that has generated `generated` without stopping."""
        return self._bounded(self._of(prompt_tokens).expected(generated, max_tokens), generated, max_tokens)

    def draw(self, generated: int, max_tokens: int, prompt_tokens: int, u: float) -> int:
        """The same row's total output tokens at quantile u (0..1) of its distribution."""
        return self._bounded(self._of(prompt_tokens).quantile(generated, max_tokens, u), generated, max_tokens)

    @staticmethod
    def _bounded(tokens: float, generated: int, max_tokens: int) -> int:
        return min(max_tokens, max(generated + 1, round(tokens)))

    def _of(self, prompt_tokens: int) -> KaplanMeier:
        return self._nearest_rows(prompt_tokens) or self._by_class.get(length_class(prompt_tokens)) or self._all

    def _nearest_rows(self, prompt_tokens: int) -> KaplanMeier | None:
        """The lengths of the NEIGHBOURS finished rows of the class nearest prompt_tokens (every row of the
        window's edge lengths with them), and of the running rows within their prompt lengths; None while the class
        has fewer finished rows."""
        c = length_class(prompt_tokens)
        first = bisect.bisect_left(self._sorted, (1 << (c - 1),)) if c > 1 else 0
        end = bisect.bisect_left(self._sorted, (1 << c,))
        if end - first < NEIGHBOURS:
            return None
        lo = hi = min(max(bisect.bisect_left(self._sorted, (prompt_tokens,)), first), end)
        while hi - lo < NEIGHBOURS:
            if hi == end or (lo > first and prompt_tokens - self._sorted[lo - 1][0]
                             <= self._sorted[hi][0] - prompt_tokens):
                lo -= 1
            else:
                hi += 1
        while lo > first and self._sorted[lo - 1][0] == self._sorted[lo][0]:
            lo -= 1
        while hi < end and self._sorted[hi][0] == self._sorted[hi - 1][0]:
            hi += 1
        km = self._nearest.get((lo, hi))
        if km is None:
            rows = self._sorted[lo:hi]
            shortest, longest = rows[0][0], rows[-1][0]
            running = [(c, n, True) for p, n in self._running if shortest <= p <= longest]
            km = self._nearest[lo, hi] = _kaplan_meier(rows + running)
        return km


def _kaplan_meier(rows) -> KaplanMeier:
    """rows: (key, tokens generated, cut or still running)."""
    return KaplanMeier([n for _, n, cut in rows if not cut], [n for _, n, cut in rows if cut])
