"""Interactive lane: own KV pool, admitted first, capped, takes seats from the batch lane, never the reverse."""
import pytest

from batchrun import LLM, SamplingParams
from conftest import random_prompts, reference_greedy

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def lane_llm(path, **options):
    return LLM(model=path, block_size=4, kv_cache_memory="4MiB", interactive_lane=True,
               interactive_kv_memory="1MiB", **options)


def test_lanes_have_own_pools_and_exact_outputs(tiny_model):
    path, model = tiny_model
    llm = lane_llm(path, kv_cache_dtype="int8", max_num_batched_tokens=16)
    interactive_lane, batch_lane = llm.engine.scheduler.lanes
    assert (interactive_lane.name, batch_lane.name) == ("interactive", "batch")
    assert [p.dtype for p in llm.engine.runner.pools] == [llm.engine.dtype, llm.engine.kv_dtype]
    batch = [llm.engine.add_request(p, GREEDY, lane="batch") for p in random_prompts([20, 25, 30], seed=1)]
    chat = llm.engine.add_request(random_prompts([12], seed=2)[0], GREEDY, lane="interactive")
    outputs = {o.request_id: o for o in llm.engine.step()}
    # Interactive first, capped at half of the 16-token budget; the batch lane keeps the other half.
    assert chat.num_computed_tokens == 8
    assert sum(r.num_computed_tokens for r in batch) == 8
    while llm.engine.has_unfinished():
        outputs.update({o.request_id: o for o in llm.engine.step() if o.finished})
    # The interactive lane's KV is unquantized: its output is exact.
    assert outputs[chat.request_id].token_ids == reference_greedy(model, chat.prompt_token_ids, 8)
    assert all(len(outputs[r.request_id].token_ids) == 8 for r in batch)
    for lane in llm.engine.scheduler.lanes:
        lane.block_manager.check_integrity()
        assert lane.block_manager.num_free_blocks == lane.block_manager.num_blocks


def test_interactive_takes_a_seat_from_batch(tiny_model):
    path, model = tiny_model
    llm = lane_llm(path, max_num_seqs=2)
    prompts = random_prompts([10, 11, 9], seed=4)
    batch = [llm.engine.add_request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
             for p in prompts[:2]]
    for _ in range(3):
        llm.engine.step()
    assert len(llm.engine.scheduler.lanes[1].running) == 2
    chat = llm.engine.add_request(prompts[2], GREEDY, lane="interactive")
    llm.engine.step()
    assert llm.engine.stats.preemptions == 1
    assert [r.lane for r in llm.engine.scheduler.running] == ["interactive", "batch"]
    done = {}
    while llm.engine.has_unfinished():
        done.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert done[chat.request_id].token_ids == reference_greedy(model, prompts[2], 8)
    for request, prompt in zip(batch, prompts):   # the preempted request recomputed and still matches
        assert done[request.request_id].token_ids == reference_greedy(model, prompt, 30)


def test_batch_never_preempts_interactive(tiny_model):
    path, _ = tiny_model
    llm = lane_llm(path, max_num_seqs=2, interactive_max_num_seqs=2)
    for p in random_prompts([6, 7], seed=5):
        llm.engine.add_request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), lane="interactive")
    llm.engine.step()
    llm.engine.add_request(random_prompts([5], seed=6)[0], GREEDY, lane="batch")
    while llm.engine.scheduler.lanes[0].running:
        llm.engine.step()
        assert llm.engine.stats.preemptions == 0
        assert not llm.engine.scheduler.lanes[1].running   # no seat left for batch until interactive finishes


def test_batch_lane_yields_to_interactive_requests_down_to_its_cap(tiny_model):
    path, model = tiny_model
    llm = lane_llm(path, max_num_batched_tokens=64, batch_tokens_while_interactive=2)
    prompts = random_prompts([9, 10, 11, 12, 7], seed=7)
    batch = [llm.engine.add_request(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
             for p in prompts[:4]]
    llm.engine.step()
    assert [r.num_computed_tokens for r in batch] == [9, 10, 11, 12]   # alone: the whole budget
    chat = llm.engine.add_request(prompts[4], GREEDY, lane="interactive")
    done = {}
    while llm.engine.scheduler.lanes[0].running or llm.engine.scheduler.lanes[0].waiting:
        before = sum(r.num_computed_tokens for r in batch)
        done.update({o.request_id: o for o in llm.engine.step() if o.finished})
        assert sum(r.num_computed_tokens for r in batch) - before <= 2   # batch keeps two tokens a step
    after_chat = sum(r.num_computed_tokens for r in batch)
    llm.engine.step()
    assert sum(r.num_computed_tokens for r in batch) - after_chat == 4   # the interactive lane is empty again
    while llm.engine.has_unfinished():
        done.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert done[chat.request_id].token_ids == reference_greedy(model, prompts[4], 8)
    for request, prompt in zip(batch, prompts):
        assert done[request.request_id].token_ids == reference_greedy(model, prompt, 20)


def test_a_lane_is_resolved_when_the_request_is_added(tiny_llm):
    """An unknown lane is refused at once (it used to fall back to the last lane silently each step); "interactive"
    on an engine without an interactive lane is its batch lane, the one pool there is."""
    with pytest.raises(ValueError, match="lane: unknown lane 'fast'; this engine has batch"):
        tiny_llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), lane="fast")
    request = tiny_llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), lane="interactive")
    assert request.lane == "batch"
    while tiny_llm.has_unfinished():
        tiny_llm.step()
