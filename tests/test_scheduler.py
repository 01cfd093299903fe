"""The scheduler alone, on the planner's fake forward: budget split, chunked prefill, lanes, seats, preemption order,
and the one step update (append, stop rules, free)."""
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.request import Request, RequestStatus
from batchrun.engine.scheduler import Lane, Scheduler, WaitingQueue
from batchrun.engine.stop import StopRule
from batchrun.sampling_params import SamplingParams
from batchrun.stepmodel.simulate import fake_forward


def request(name, prompt_len, max_tokens=1, lane="batch", **params):
    return Request(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0, **params),
                   lane=lane)


def single(num_blocks=100, block_size=4, max_num_seqs=8, budget=10):
    return Scheduler.single_lane(BlockManager(num_blocks, block_size, enable_prefix_caching=False), max_num_seqs,
                                 budget)


def step(scheduler):
    """One step: the plan as (name, tokens) pairs, the names that sampled, and the names that finished."""
    plan = scheduler.schedule()
    scheduled = [(r.request_id, n) for r, n in plan.scheduled]
    sampled = [r.request_id for r in plan.sampling]
    finished = [r.request_id for r in fake_forward(scheduler, plan)]
    return scheduled, sampled, finished, plan


def test_budget_is_split_by_chunked_prefill_and_decodes_go_first():
    s = single(budget=10)
    for r in (request("a", 8, 2), request("b", 8, 2), request("c", 8)):
        s.add(r)
    assert step(s)[:3] == ([("a", 8), ("b", 2)], ["a"], [])             # b starts with what a leaves
    assert step(s)[:3] == ([("a", 1), ("b", 6), ("c", 3)], ["a", "b"], ["a"])
    assert step(s)[:3] == ([("b", 1), ("c", 5)], ["b", "c"], ["b", "c"])
    assert not s.has_unfinished() and s.lanes[0].block_manager.num_free_blocks == 100


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_and_samples_once():
    s = single(budget=10)
    r = request("long", 25, 2)
    s.add(r)
    assert [step(s)[:2] for _ in range(4)] == [([("long", 10)], []), ([("long", 10)], []), ([("long", 5)], ["long"]),
                                               ([("long", 1)], ["long"])]
    assert r.finished and r.output_token_ids == [0, 0] and r.finish_reason == "length"


def test_steps_of_decodes_alone_leave_the_chunks_and_admissions_for_after():
    s = single(budget=10)
    s.add(request("a", 4, 5))
    s.add(request("b", 25, 2))
    assert step(s)[0] == [("a", 4), ("b", 6)]
    s.add(request("c", 4, 2))
    s.run_decodes_alone(2)
    assert [step(s)[0] for _ in range(2)] == [[("a", 1)], [("a", 1)]]   # b's chunk and c's admission wait
    assert step(s)[0] == [("a", 1), ("b", 9)]                           # then the steps are as before
    assert step(s)[0] == [("a", 1), ("b", 9)]
    s = single(budget=10)   # no request decoding yet: the asked steps wait for one
    s.add(request("long", 25, 3))
    s.run_decodes_alone(1)
    assert [step(s)[0] for _ in range(3)] == [[("long", 10)], [("long", 10)], [("long", 5)]]
    assert s.decode_steps_asked == 1
    assert step(s)[0] == [("long", 1)] and s.decode_steps_asked == 0


def test_steps_of_decodes_alone_never_hold_back_an_interactive_request():
    s = lanes(budget=10, interactive_cap=10, yield_cap=10)
    s.add(request("a", 4, 5))
    s.add(request("b", 25, 2))
    assert step(s)[0] == [("a", 4), ("b", 6)]
    s.add(request("chat", 6, 2, lane="interactive"))
    s.add(request("c", 4, 2))
    s.run_decodes_alone(1)
    assert step(s)[0] == [("chat", 6), ("a", 1)]   # the chat prefills; b's chunk and c's admission wait
    assert step(s)[0] == [("chat", 1), ("a", 1), ("b", 8)]


def test_max_num_seqs_caps_admission():
    s = single(max_num_seqs=2, budget=100)
    for name in "abc":
        s.add(request(name, 4, 3))
    assert [name for name, _ in step(s)[0]] == ["a", "b"]
    assert s.num_waiting == 1


def lanes(max_num_seqs=8, budget=10, interactive_cap=4, yield_cap=3):
    interactive = Lane("interactive", BlockManager(50, 4, False), max_num_seqs, interactive_cap, WaitingQueue())
    batch = Lane("batch", BlockManager(50, 4, False), max_num_seqs, budget, WaitingQueue(), yield_cap=yield_cap)
    return Scheduler([interactive, batch], max_num_seqs, budget)


def test_interactive_lane_goes_first_within_its_cap_and_batch_yields_only_while_it_is_busy():
    s = lanes(budget=10, interactive_cap=4, yield_cap=3)
    s.add(request("B", 20, 1))
    s.add(request("I", 6, 1, lane="interactive"))
    assert step(s)[:3] == ([("I", 4), ("B", 3)], [], [])
    assert step(s)[:3] == ([("I", 2), ("B", 3)], ["I"], ["I"])
    assert step(s)[:3] == ([("B", 10)], [], [])          # interactive done: batch has the whole budget back
    assert s.lanes[0].block_manager.num_free_blocks == 50   # each lane frees into its own pool


def test_a_higher_lane_takes_a_seat_from_the_batch_lane_never_the_reverse():
    s = lanes(max_num_seqs=2, budget=100, interactive_cap=100, yield_cap=None)
    b1, b2 = request("b1", 4, 5), request("b2", 4, 5)
    s.add(b1)
    s.add(b2)
    step(s)
    s.add(request("i1", 4, 5, lane="interactive"))
    scheduled, _, _, plan = step(s)
    assert plan.preempted == [b2] and scheduled == [("i1", 4), ("b1", 1)]   # the last admitted batch request
    s.add(request("i2", 4, 5, lane="interactive"))
    scheduled, _, _, plan = step(s)
    assert plan.preempted == [b1] and [n for n, _ in scheduled] == ["i1", "i2"]
    s.add(request("b3", 4, 1))
    assert all(name.startswith("i") for name, _ in step(s)[0])   # both seats interactive: batch waits


def test_a_full_pool_preempts_the_last_admitted_which_recomputes_and_finishes():
    s = single(num_blocks=4, block_size=4, budget=100)
    a, b, c = request("a", 4, 8), request("b", 4, 8), request("c", 4, 8)
    for r in (a, b, c):
        s.add(r)
    assert step(s)[0] == [("a", 4), ("b", 4), ("c", 4)]          # one block each, one left
    scheduled, _, _, plan = step(s)
    assert scheduled == [("a", 1), ("b", 1)] and plan.preempted == [c]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    for _ in range(200):
        if not s.has_unfinished():
            break
        step(s)
    assert all(r.finished and len(r.output_token_ids) == 8 for r in (a, b, c))
    assert s.num_preemptions >= 1 and s.lanes[0].block_manager.num_free_blocks == 4
    s.lanes[0].block_manager.check_integrity()


def test_update_applies_the_stop_rules_and_frees_only_what_finished():
    s = Scheduler.single_lane(BlockManager(20, 4, False), 8, 100)
    s.stop_rule = StopRule(eos_token_ids=frozenset({2}), max_model_len=7)
    eos, ignores_eos, stop_id, long = (request("eos", 3, 5), request("ignores", 3, 5, ignore_eos=True),
                                       request("stop_id", 3, 5, stop_token_ids=[9]), request("long", 5, 10))
    for r in (eos, ignores_eos, stop_id, long):
        s.add(r)
    plan = s.schedule()
    finished = s.update(plan, [(eos, 2, -0.5), (ignores_eos, 2, None), (stop_id, 9, None), (long, 4, None)])
    assert finished == [eos, stop_id]
    assert (eos.finish_reason, stop_id.finish_reason, eos.logprobs) == ("stop", "stop", [-0.5])
    assert [r.request_id for r in s.running] == ["ignores", "long"]
    assert not eos.block_table and ignores_eos.block_table
    plan = s.schedule()
    assert s.update(plan, [(ignores_eos, 5, None), (long, 5, None)]) == [long]   # 7 tokens: the model's context
    assert long.finish_reason == "length" and ignores_eos.status is RequestStatus.RUNNING


class CountingTokenizer:
    """Token i < 26 is a letter; 26 and 27 spell 'ST' and 'OP'. Counts the token ids it decodes."""
    pieces = [chr(97 + i) for i in range(26)] + ["ST", "OP"]

    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return "".join(self.pieces[i] for i in ids)


def test_stop_strings_are_found_in_linear_time_over_a_long_output():
    tokenizer = CountingTokenizer()
    rule = StopRule(tokenizer=tokenizer)
    r = request("long", 3, 3000, stop=["STOP", "never"])
    reasons = []
    for i in range(1998):
        r.token_ids.append(i % 26)
        reasons.append(rule(r))
    for token in (26, 27):
        r.token_ids.append(token)
        reasons.append(rule(r))
    assert reasons[:-1] == [None] * 1999 and reasons[-1] == "stop"
    assert r.text == "".join(chr(97 + i % 26) for i in range(1998))
    assert tokenizer.decoded < 2000 * (4 * len("never") + 4) + 2000   # quadratic would be ~2,000,000
