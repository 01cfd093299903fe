"""The ETA's output-length forecast (batchrun/job/output_lengths.py): running rows and rows cut by max_tokens are
lower bounds (Kaplan-Meier), read by prompt-length class where a class has rows enough of its own, and within a
class from its rows nearest in prompt length."""
from batchrun.job.output_lengths import OutputLengths


def test_output_lengths_count_running_rows_as_lower_bounds():
    lengths = OutputLengths()
    assert lengths.expected(0, 100, 10) == 100                  # nothing observed yet: max_tokens
    lengths = OutputLengths([(10, 10, False)] * 9)              # (prompt tokens, generated, cut by max_tokens)
    lengths.fit(running=[(10, 50)])                             # one row still running after 50 tokens
    assert lengths.expected(0, 100, 10) == 19                   # 0.9 x 10 + 0.1 x 100 (the unseen tail at max)
    assert lengths.expected(60, 100, 10) == 100
    lengths.fit(running=[])
    assert lengths.expected(0, 100, 10) == 10 and lengths.expected(10, 100, 10) == 100


def test_rows_cut_by_max_tokens_are_lower_bounds_not_lengths():
    # answers of 30 tokens: ten rows with max_tokens 20 are cut at 20, ten with 200 stop at 30. A new row with
    # max_tokens 200 stops at 30 (a share of max_tokens would say (1 + 0.15) / 2 x 200 = 115)
    lengths = OutputLengths([(10, 20, True)] * 10 + [(10, 30, False)] * 10)
    lengths.fit(running=[])
    assert lengths.expected(0, 200, 10) == 30 and lengths.expected(0, 10, 10) == 10


def test_output_lengths_are_read_by_prompt_length_where_enough_rows_finished():
    # questions (short prompts) stop after 10 tokens, articles (long prompts) run to their max_tokens
    lengths = OutputLengths([(8, 10, False)] * 40 + [(900, 100, True)] * 40)
    lengths.fit(running=[])
    assert lengths.expected(0, 100, 9) == 10 and lengths.expected(0, 100, 1000) == 100
    assert lengths.expected(0, 100, 60) == 55                   # a class with too few rows: all rows together


def test_a_class_with_rows_of_its_own_is_not_read_through_its_neighbours():
    # questions of 40-63 prompt tokens stop at 10; the next class (64-127) holds instructions cut at their 30
    # max_tokens. Pooled, those 20 cut rows would count as still running at 10 and price a question at 168 of 200.
    lengths = OutputLengths([(40, 10, False)] * 4 + [(100, 30, True)] * 20)
    lengths.fit(running=[])
    assert lengths.expected(0, 200, 50) == 10
    # a class with fewer rows than MIN_EVENTS of its own is still read with its neighbours'
    lengths = OutputLengths([(40, 10, False)] * 3 + [(100, 30, True)] * 20)
    lengths.fit(running=[])
    assert lengths.expected(0, 200, 50) > 100


def test_a_row_is_read_from_the_finished_rows_of_its_class_nearest_its_prompt_length():
    # one class (32-63 prompt tokens), two tasks: prompts of 34 tokens run to 200, those of 40 stop at 10. The whole
    # class would price either at 105.
    lengths = OutputLengths([(34, 200, False)] * 20 + [(40, 10, False)] * 20)
    lengths.fit(running=[])
    assert lengths.expected(0, 256, 40) == 10 and lengths.expected(0, 256, 34) == 200
    assert lengths.expected(0, 256, 41) == 10 and lengths.expected(0, 256, 33) == 200
    # the running rows within the neighbours' prompt lengths are lower bounds among them: one of 40 tokens still
    # running at 100 tokens of 21 rows
    lengths.fit(running=[(40, 100)])
    assert lengths.expected(0, 256, 40) == round((20 * 10 + 256) / 21)
    # fewer finished rows in the class than NEIGHBOURS: the whole class
    lengths = OutputLengths([(34, 200, False)] * 6 + [(40, 10, False)] * 6)
    lengths.fit(running=[])
    assert lengths.expected(0, 256, 40) == 105


def test_a_drawn_length_is_a_quantile_of_the_rows_distribution():
    lengths = OutputLengths([(8, n, False) for n in (10, 20, 30, 40)] + [(8, 50, True)])   # one cut at 50
    lengths.fit([])
    assert [lengths.draw(0, 100, 8, u) for u in (0.05, 0.3, 0.5, 0.75)] == [10, 20, 30, 40]
    assert lengths.draw(0, 100, 8, 0.95) == 100    # beyond every stop: the cut row's mass, up to max_tokens
    assert lengths.draw(0, 35, 8, 0.75) == 35      # max_tokens cuts it
    assert lengths.draw(25, 100, 8, 0.1) == 30     # given 25 generated: only the lengths above
    assert lengths.draw(45, 100, 8, 0.1) == 100
    # stratified quantiles spread as the rows do, and keep their mean
    draws = [lengths.draw(0, 100, 8, u) for u in eta_strata(1000)]
    assert sorted(set(draws)) == [10, 20, 30, 40, 100]
    assert abs(sum(draws) / len(draws) - lengths.expected(0, 100, 8)) <= 0.5


def eta_strata(count):
    from batchrun.job.eta import antithetic_strata
    values, mirrored = antithetic_strata(count)
    assert sorted(values) == [(k + 0.5) / count for k in range(count)] and mirrored == [1 - u for u in values]
    assert (values, mirrored) == antithetic_strata(count)   # fixed by the count: one job's estimates stay steady
    return values
