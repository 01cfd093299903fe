"""A row's output length, in tokens, by prompt length: from the rows finished so far, with the running ones and
those cut by max_tokens as lower bounds (Kaplan-Meier), since outputs stop early and short ones finish first."""
from __future__ import annotations

from collections import deque

import numpy as np

from batchrun.admission_order import PILOT_MIN_ROWS, length_class

KEEP = 4096               # recent steps and finished lengths kept (and saved for a resumed run)


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


class OutputLengths:
    """Output lengths by prompt length (a question and an article to summarise stop at different points, and
    bucketing runs them at different times). Lengths in tokens, not as a share of max_tokens: a row with a large
    max_tokens is most often one that stops early, so a share would price it at what rows cut by a small max_tokens
    did. Finished rows that stopped are observations; rows cut by max_tokens and running rows are censored ones."""

    MIN_EVENTS = PILOT_MIN_ROWS   # finished rows of a class (or it and its neighbours) for its own distribution

    def __init__(self, finished: list[tuple[int, int, bool]] = ()):
        # (prompt tokens, tokens generated, cut by max_tokens)
        self.finished: deque[tuple[int, int, bool]] = deque(map(tuple, finished), maxlen=KEEP)
        self._all = KaplanMeier([], [])               # nothing observed yet: every row runs to max_tokens
        self._by_class: dict[int, KaplanMeier] = {}

    def fit(self, running: list[tuple[int, int]]) -> None:
        """running: (prompt tokens, tokens generated so far) of the rows in the engine."""
        finished = [(length_class(p), n, cut) for p, n, cut in self.finished]
        censored = [(length_class(p), n, True) for p, n in running]

        def km(rows) -> KaplanMeier:
            return KaplanMeier([n for _, n, cut in rows if not cut], [n for _, n, cut in rows if cut])

        self._all = km(finished + censored)
        self._by_class = {}
        for c in {k for k, _, _ in finished}:
            # the class's own rows once there are enough: a neighbour's rows, often all cut by their max_tokens,
            # would count as rows still running at every length below their cut and push the class's lengths up
            for reach in (0, 1):
                near = [row for row in finished if abs(row[0] - c) <= reach]
                if len(near) >= self.MIN_EVENTS:
                    self._by_class[c] = km(near + [row for row in censored if abs(row[0] - c) <= reach])
                    break

    def expected(self, generated: int, max_tokens: int, prompt_tokens: int) -> int:
        """Expected total output tokens of a row that has generated `generated` without stopping."""
        km = self._by_class.get(length_class(prompt_tokens), self._all)
        return min(max_tokens, max(generated + 1, round(km.expected(generated, max_tokens))))
