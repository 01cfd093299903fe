"""The order a bucketed job admits its rows in (admission_order.window_order): the pilot at the head of the first
window, shortest first in either order, then the length order; the planner's simulation admits them the same way."""
from types import SimpleNamespace

from batchrun.job.bucketing import RowFeed
from batchrun.stepmodel.simulate import WorkItem, admission_keys


def test_the_pilot_heads_the_first_window_only():
    # first window: 32 rows of class 6 (32-63 tokens), 18 of class 7 (64-81) and 2 of class 3, shuffled; then 6 more
    first = [47, 5, 64 + 17, 6] + [n for n in range(32, 81) if n != 47]
    second = [90, 33, 70, 34, 91, 35]
    rows = [SimpleNamespace(index=i, error=None, token_ids=[0] * n) for i, n in enumerate(first + second)]

    def order(pilot, longest_first=False):
        feed = RowFeed([rows[:len(first)], rows[len(first):]], lambda batch: None, window=len(first),
                       bucketing=True, skip=set(), pilot=pilot, longest_first=longest_first)
        return [len(row.token_ids) for _, row in iter(feed.next, None)]

    # a quarter of each class, spread over it: 8 of class 6 (every 4th), 5 of class 7 (every 3.6th); class 3 has
    # fewer rows than the least a class puts in (4), so both come; then the length order, and the second window
    pilot = [5, 6] + list(range(32, 64, 4)) + [64, 67, 71, 74, 78]
    rest = sorted(n for n in first if n not in pilot)
    assert order(0.25) == pilot + rest + sorted(second)
    assert order(0) == sorted(first) + sorted(second)
    # longest first, the pilot (spread over each class from its longest row down) still runs shortest first
    pilot = [5, 6] + list(range(35, 64, 4)) + [67, 71, 74, 78, 81]
    rest = sorted((n for n in first if n not in pilot), reverse=True)
    assert order(0.25, True) == pilot + rest + sorted(second, reverse=True)


def test_the_planner_simulates_the_feeds_order():
    lengths = [(i * 37) % 300 + 1 for i in range(50)]
    rows = [SimpleNamespace(index=i, error=None, token_ids=[0] * n) for i, n in enumerate(lengths)]
    for longest_first in (False, True):
        feed = RowFeed([rows[:20], rows[20:40], rows[40:]], lambda batch: None, window=20, bucketing=True, skip=set(),
                       longest_first=longest_first, pilot=0.1)
        keys = admission_keys([WorkItem(n, 1) for n in lengths], True, 20, longest_first, pilot=0.1)
        assert [row.index for _, row in iter(feed.next, None)] == sorted(range(50), key=keys.__getitem__)
