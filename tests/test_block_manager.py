"""Block manager bookkeeping: allocation, sharing, ref counts, eviction, no double free."""
import pytest

from batchrun.engine.block_manager import BlockManager
from batchrun.engine.request import Request
from batchrun.sampling_params import SamplingParams


def make_request(tokens):
    return Request("r", list(tokens), SamplingParams())


def admit(bm, request):
    hits = bm.get_computed_blocks(request)
    assert bm.allocate_slots(request, request.num_tokens - len(hits) * bm.block_size, hits)
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request, request.num_tokens)
    return hits


def test_allocate_grow_and_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_request(range(6))
    assert bm.allocate_slots(r, 6)
    assert len(r.block_table) == 2 and bm.num_free_blocks == 6
    r.num_computed_tokens = 6
    assert bm.allocate_slots(r, 2)            # fits in the second block
    assert len(r.block_table) == 2
    assert bm.allocate_slots(r, 3)            # needs a third
    assert len(r.block_table) == 3
    bm.free_request(r)
    assert bm.num_free_blocks == 8 and r.block_table == []
    bm.check_integrity()


def test_allocation_failure_has_no_side_effects():
    bm = BlockManager(num_blocks=2, block_size=4)
    r = make_request(range(12))
    assert not bm.allocate_slots(r, 12)
    assert r.block_table == [] and bm.num_free_blocks == 2


def test_shared_prefix_ref_counts_and_verification():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = make_request(range(10)), make_request(list(range(8)) + [99, 98, 97])
    assert admit(bm, a) == []
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert [bm.ref_counts[x] for x in hits] == [2, 2]
    bm.free_request(a)
    assert [bm.ref_counts[x] for x in hits] == [1, 1]
    bm.free_request(b)
    bm.check_integrity()
    assert bm.num_free_blocks == 16
    # Freed blocks stay cached until evicted: a third request still hits them.
    c = make_request(range(9))
    assert admit(bm, c) == hits
    # A hash collision cannot corrupt output: stored tokens are compared on a hit.
    bm.block_tokens[hits[0]] = (7, 7, 7, 7)
    assert bm.get_computed_blocks(make_request(range(9))) == []


def test_hit_capped_one_token_short():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, make_request(range(8)))
    assert len(bm.get_computed_blocks(make_request(range(8)))) == 1   # the last token must be computed


def test_lru_eviction_and_double_free():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request(range(8))
    admit(bm, a)
    bm.free_request(a)
    b = make_request(range(100, 116))          # needs all 4 blocks: evicts a's cached blocks
    admit(bm, b)
    assert bm.get_computed_blocks(make_request(range(9))) == []
    bm.check_integrity()
    table = list(b.block_table)
    bm.free_request(b)
    b.block_table = table
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free_request(b)


def test_reset_prefix_cache_forgets_free_blocks_only():
    """A benchmark's repeated run starts from no cached prompt, while a running request keeps its blocks' hashes."""
    bm = BlockManager(num_blocks=16, block_size=4)
    done, running = make_request(range(10)), make_request(range(100, 110))
    admit(bm, done)
    admit(bm, running)
    bm.free_request(done)
    assert bm.reset_prefix_cache() == 2   # done's two full blocks
    bm.check_integrity()
    assert bm.get_computed_blocks(make_request(range(10))) == []
    assert bm.get_computed_blocks(make_request(range(100, 110))) == running.block_table[:2]
    assert bm.reset_prefix_cache() == 0


def test_llm_reset_prefix_cache_recomputes_a_repeated_prompt(tiny_model):
    from batchrun import LLM, SamplingParams
    path, _ = tiny_model
    llm = LLM(model=path, dtype="float32", block_size=4)
    prompt, params = list(range(3, 23)), SamplingParams(max_tokens=2, temperature=0)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.generate([prompt], params, use_tqdm=False)[0].cached_tokens > 0
    assert llm.reset_prefix_cache() > 0
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.cached_tokens == 0 and again.token_ids == first.token_ids
    llm.start_background()
    try:
        with pytest.raises(RuntimeError, match="stop_background"):
            llm.reset_prefix_cache()
    finally:
        llm.stop_background()
