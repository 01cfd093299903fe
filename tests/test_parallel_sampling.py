"""n samples per prompt: the prompt is prefilled once and its KV blocks shared by the samples."""
import pytest
import torch

from batchrun import LLM, SamplingParams
from conftest import random_prompts

BLOCK = 4


@pytest.fixture
def llm(tiny_model):
    return LLM(model=tiny_model[0], block_size=BLOCK, kv_cache_memory="4MiB", enable_prefix_caching=False)


def test_samples_share_the_prompt_blocks(llm):
    """n = 8 on a 50-token prompt: its 12 full blocks once, plus per sample the copied partial block; prefill
    computed once."""
    prompt = random_prompts([50], seed=4)[0]
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(n=8, max_tokens=3, temperature=1.0, seed=1, ignore_eos=True),
                       request_id="p")
    engine.step()                                   # the prefill: the 8 samples fork after it
    samples = engine.requests["p"]
    assert len(samples) == 8
    full = 50 // BLOCK
    assert all(s.block_table[:full] == samples[0].block_table[:full] for s in samples)
    assert len({s.block_table[full] for s in samples}) == 8   # the partial block: one private copy each
    assert engine.stats.kv_blocks_used == full + 8
    assert engine.stats.prompt_tokens == 50
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert sorted(o.sample_index for o in outs) == list(range(8))
    assert engine.stats.prompt_tokens == 50          # never recomputed
    assert engine.stats.output_tokens == 8 * 3
    assert "p" not in engine.requests
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_seeded_samples_are_reproducible_and_differ(llm):
    prompts = random_prompts([9, 17], seed=5)
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.request_id, o.sample_index) for o in first] == [(o.request_id, o.sample_index) for o in first[:4]] \
        + [(o.request_id, o.sample_index) for o in first[4:]]
    assert [o.sample_index for o in first] == [0, 1, 2, 3] * 2
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in first[:4]}) == 4
    # sample k is the request with seed + k, sampled alone
    alone = llm.generate(prompts[0], SamplingParams(max_tokens=10, temperature=1.0, seed=9, ignore_eos=True),
                         use_tqdm=False)
    assert alone[0].token_ids == first[2].token_ids


def test_greedy_samples_match_a_single_request(llm, tiny_model):
    prompt = random_prompts([13], seed=6)
    single = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    many = llm.generate(prompt, SamplingParams(n=3, max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in many] == [single[0].token_ids] * 3


def test_preempted_sample_leaves_its_siblings_blocks_intact(tiny_model):
    """A pool too small for all samples: samples are preempted and recompute, the shared prompt blocks stay with
    the others. The greedy outputs equal the roomy run, and freed blocks are poisoned so a sibling still reading
    one would go wrong."""
    path, _ = tiny_model
    prompts = random_prompts([22, 15], seed=8)
    params = SamplingParams(n=4, max_tokens=24, temperature=0, ignore_eos=True)
    roomy = LLM(model=path, block_size=BLOCK, kv_cache_memory="4MiB").generate(prompts, params, use_tqdm=False)
    # 512 bytes per token: a 96-token pool for 8 sequences of up to 46 tokens
    tight = LLM(model=path, block_size=BLOCK, kv_cache_memory=512 * 96, max_model_len=96,
                max_num_batched_tokens=32)
    engine = tight.engine
    manager = engine.block_manager
    free_request = manager.free_request

    def free_and_poison(request):
        free_request(request)
        # free and not kept for the prefix cache (those are read again on a cache hit)
        freed = [b for b in range(manager.num_blocks) if manager.ref_counts[b] == 0 and manager.block_hash[b] is None]
        engine.runner.pools[0].data[:, :, freed] = 50.0   # finite: padding reads stay masked

    manager.free_request = free_and_poison
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert engine.stats.preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    manager.check_integrity()


def test_prefill_tokens_and_blocks_against_separate_requests(tiny_model):
    path, _ = tiny_model
    prompt = random_prompts([64], seed=9)[0]
    forked = LLM(model=path, block_size=BLOCK, kv_cache_memory="4MiB", enable_prefix_caching=False)
    forked.generate([prompt], SamplingParams(n=8, max_tokens=4, temperature=1.0, seed=0), use_tqdm=False)
    separate = LLM(model=path, block_size=BLOCK, kv_cache_memory="4MiB", enable_prefix_caching=False)
    separate.generate([prompt] * 8, SamplingParams(max_tokens=4, temperature=1.0, seed=0), use_tqdm=False)
    assert separate.engine.stats.prompt_tokens == 8 * forked.engine.stats.prompt_tokens


def test_bad_n():
    with pytest.raises(ValueError, match="n: must be a positive integer"):
        SamplingParams(n=0)
    torch.manual_seed(0)
