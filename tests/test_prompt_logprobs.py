"""SamplingParams(prompt_logprobs=True): each prompt token's log-probability given the tokens before it, equal to
transformers' teacher-forced log-softmax, through chunked prefill, the prefix cache, preemption and n > 1."""
from __future__ import annotations

import pytest
import torch

from batchrun import LLM, SamplingParams
from conftest import random_prompts


def reference_prompt_logprobs(model, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


def assert_scored(out, model, prompt):
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    expected = reference_prompt_logprobs(model, prompt)
    assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), torch.tensor(expected), atol=1e-4)


def test_prompt_logprobs_match_reference_through_chunks(tiny_model):
    path, model = tiny_model
    # A 7-token budget cuts the 30- and 50-token prompts into chunks, in steps shared with the others' decodes.
    llm = LLM(model=path, block_size=4, max_num_batched_tokens=7, kv_cache_memory="4MiB")
    prompts = random_prompts([30, 9, 50, 1], seed=5)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, prompt in zip(outs, prompts):
        assert_scored(out, model, prompt)
    plain = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_prompt_logprobs_bypass_the_prefix_cache(tiny_model):
    path, model = tiny_model
    llm = LLM(model=path, block_size=4, max_num_batched_tokens=64, kv_cache_memory="4MiB")
    prompt = random_prompts([21], seed=6)[0]
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)   # fills the cache
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=True),
                       use_tqdm=False)[0]
    assert out.cached_tokens == 0
    assert_scored(out, model, prompt)
    again = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert again.cached_tokens > 0   # the scored request still leaves its blocks to the cache


def test_prompt_logprobs_once_each_under_preemption_and_samples(tiny_model):
    path, model = tiny_model
    # 48 tokens of pool for six prompts that grow to 28-34 tokens: requests are preempted and recomputed.
    llm = LLM(model=path, block_size=4, kv_cache_memory=512 * 48, max_num_batched_tokens=32, max_model_len=48)
    prompts = random_prompts([10, 12, 9, 14, 11, 8], seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                prompt_logprobs=True), use_tqdm=False)
    assert llm.engine.stats.preemptions > 0
    for out, prompt in zip(outs, prompts):
        assert_scored(out, model, prompt)
    outs = llm.generate([prompts[0]], SamplingParams(max_tokens=2, n=3, seed=1, prompt_logprobs=True),
                        use_tqdm=False)
    assert len(outs) == 3
    for out in outs:
        assert_scored(out, model, prompts[0])


def test_prompt_logprobs_must_be_a_bool():
    with pytest.raises(ValueError, match="prompt_logprobs: must be true or false"):
        SamplingParams(prompt_logprobs=5)
