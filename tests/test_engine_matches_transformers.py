"""Greedy outputs equal transformers `generate` token for token (float32, tiny random models)."""
import pytest

from batchrun import LLM, SamplingParams
from conftest import random_prompts, reference_greedy, save_tiny_model

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def assert_matches(llm, model, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "length", out.error
        assert out.token_ids == reference_greedy(model, prompt, max_tokens)
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("block_size", [4, 16])
def test_prompts_around_block_size(tiny_model, block_size):
    path, model = tiny_model
    llm = LLM(model=path, block_size=block_size, kv_cache_memory="4MiB")
    lengths = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2]
    assert_matches(llm, model, random_prompts(lengths, seed=block_size))


def test_chunked_prefill_small_budget(tiny_model):
    path, model = tiny_model
    llm = LLM(model=path, block_size=4, max_num_batched_tokens=7, kv_cache_memory="4MiB")
    assert_matches(llm, model, random_prompts([30, 9, 50, 2]))


def test_forced_preemption_tiny_pool(tiny_model):
    path, model = tiny_model
    # 2 layers x 2 kv heads x 16 dims x 2 (K,V) x 4 bytes = 512 bytes per token; 48 tokens of pool.
    llm = LLM(model=path, block_size=4, kv_cache_memory=512 * 48, max_num_batched_tokens=32, max_model_len=48)
    prompts = random_prompts([10, 12, 9, 14, 11, 8], seed=3)
    assert_matches(llm, model, prompts, max_tokens=20)
    assert llm.engine.stats.preemptions > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_prefix(tiny_model, prefix_caching):
    path, model = tiny_model
    llm = LLM(model=path, block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=prefix_caching)
    system = random_prompts([21], seed=7)[0]
    prompts = [system + tail for tail in random_prompts([3, 5, 1, 8], seed=8)]
    assert_matches(llm, model, prompts[:1])       # the first run fills the cache
    assert_matches(llm, model, prompts[1:] + prompts[:1])
    hits = llm.engine.stats.prefix_cache_hit_tokens
    assert hits == (4 * 20 if prefix_caching else 0)   # 5 full blocks (20 tokens) of the prefix, for 4 requests


@pytest.mark.parametrize("budget", [16, 2048])
def test_a_prefix_computed_in_the_same_step_is_shared(tiny_model, budget):
    """Requests admitted together behind one system prompt: the first computes it, the others read its blocks in
    the same step (with a 16-token budget, the blocks its chunk fills by then) instead of computing it again."""
    path, model = tiny_model
    llm = LLM(model=path, block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=budget)
    system = random_prompts([21], seed=7)[0]
    prompts = [system + tail for tail in random_prompts([3, 5, 1, 8], seed=8)]
    computed = []
    llm.engine.observe(lambda stats: computed.append(stats.shape.tokens))
    assert_matches(llm, model, prompts)
    assert llm.engine.stats.prefix_cache_hit_tokens == 3 * 20   # 5 full blocks of the prefix, for 3 requests
    assert computed[0] == (24 + 6 + 2 + 9 if budget > 64 else 16)   # the prefix's 21st token and each tail


def test_a_failed_forward_takes_back_the_blocks_it_was_to_fill(tiny_model, monkeypatch):
    """A forward that raises (Ctrl-C in a notebook) after a request was admitted on a prefix another request was
    computing in that step: no unwritten block stays in the prefix cache, the reader waits and recomputes, and every
    output still equals transformers'."""
    path, model = tiny_model
    llm = LLM(model=path, block_size=4, kv_cache_memory="4MiB")
    engine = llm.engine
    system = random_prompts([21], seed=7)[0]
    prompts = [system + tail for tail in random_prompts([3, 5], seed=8)]
    first, reader = (engine.add_request(p, GREEDY) for p in prompts)
    real_run = engine.runner.run

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(engine.runner, "run", real_run)
        raise KeyboardInterrupt
    monkeypatch.setattr(engine.runner, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.block_manager.cached == {} and first.block_hashes == []
    assert reader.status.value == "waiting" and reader.num_computed_tokens == 0 and reader.block_table == []
    engine.block_manager.check_integrity()
    outputs = {}
    while engine.scheduler.has_unfinished():
        outputs.update((out.request_id, out.token_ids) for out in engine.step() if out.finished)
    for request, prompt in zip((first, reader), prompts):
        assert outputs[request.request_id] == reference_greedy(model, prompt, MAX_TOKENS)
    assert engine.stats.prefix_cache_hit_tokens == 20 + 20   # the reader's first admission, then its second


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_other_architectures(tmp_path, model_type):
    model = save_tiny_model(tmp_path, model_type, seed=1)
    llm = LLM(model=str(tmp_path), block_size=8, kv_cache_memory="4MiB", max_num_batched_tokens=16)
    assert_matches(llm, model, random_prompts([5, 19, 33], seed=2))
