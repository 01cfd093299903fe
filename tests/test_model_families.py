"""Every supported family against transformers' own implementation on a tiny random model (float32): greedy tokens
identical for 32 tokens on several prompts, chosen-token logprobs close (final-logit soft-capping never changes the
argmax), also with chunked prefill and forced preemption; sliding-window families get prompts longer than the
window. The int8 KV path runs on each family (no exactness bound there)."""
import copy

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.models.moe import SparseMoE
from conftest import VOCAB, random_prompts, save_tiny_model, tiny_config

WINDOW = 12
MAX_TOKENS = 32
LAYER_TYPES = ["sliding_attention", "full_attention"]
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=LAYER_TYPES,
             hidden_activation="gelu_pytorch_tanh")
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                original_max_position_embeddings=48, short_factor=[1.0, 1.5, 2.0, 2.5],
                long_factor=[2.0, 3.0, 4.0, 6.0])
FAMILIES = {
    "qwen3": ("qwen3", dict(head_dim=16)),
    "qwen3-sliding": ("qwen3", dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                                    max_window_layers=1)),
    "olmo2": ("olmo2", {}),
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "gemma2": ("gemma2", dict(GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", dict(GEMMA, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        final_logit_softcapping=3.0)),
    "phi3": ("phi3", dict(pad_token_id=0, sliding_window=WINDOW)),
    # 16-dim heads, 8 rotary dims: 4 factors; the 48-token original length is crossed during generation.
    "phi3-longrope": ("phi3", dict(pad_token_id=0, max_position_embeddings=96, original_max_position_embeddings=48,
                                   rope_parameters=LONGROPE)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True)),
}


def reference(model, prompt, max_tokens=MAX_TOKENS):
    """transformers' greedy tokens, chosen-token logprobs and the smallest top-1/top-2 logit margin."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = VOCAB   # never produced: run to max_new_tokens
    out = model.generate(torch.tensor([prompt]), generation_config=config, max_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.cat(out.logits).float()
    logprobs = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens].tolist()
    top2 = logits.topk(2, dim=-1).values
    return tokens, logprobs, float((top2[:, 0] - top2[:, 1]).min())


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    model_type, overrides = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(path, model_type, seed=1, **overrides)
    prompts = random_prompts([5, 19, 33], seed=2)
    return str(path), model, prompts, [reference(model, p) for p in prompts]


def check(llm, prompts, expected, logprobs: bool):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, (tokens, ref_logprobs, margin) in zip(outs, expected):
        assert margin > 1e-4, "greedy margin too thin to compare: pick another seed"
        assert out.finish_reason == "length", out.error
        assert out.token_ids == tokens
        if logprobs:
            assert out.logprobs == pytest.approx(ref_logprobs, abs=1e-4)
    llm.engine.block_manager.check_integrity()


def test_greedy_and_logprobs_match(family):
    path, _, prompts, expected = family
    check(LLM(model=path, block_size=8, kv_cache_memory="4MiB", max_num_batched_tokens=256), prompts, expected,
          logprobs=True)


def test_chunked_prefill_and_preemption(family):
    path, model, prompts, expected = family
    attn = LLM(model=path, block_size=8, kv_cache_memory="4MiB").engine.model.model.layers[0].self_attn
    per_token = 2 * model.config.num_hidden_layers * attn.num_kv_heads * attn.head_dim * 4
    llm = LLM(model=path, block_size=4, kv_cache_memory=per_token * 80, max_num_batched_tokens=16, max_model_len=72)
    check(llm, prompts, expected, logprobs=False)
    assert llm.engine.stats.preemptions > 0


def test_int8_kv_runs(family):
    path, _, prompts, _ = family
    outs = LLM(model=path, block_size=8, kv_cache_memory="4MiB", kv_cache_dtype="int8").generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(out.finish_reason == "length" and len(out.token_ids) == 8 for out in outs)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_moe_groups_tokens_by_expert(tmp_path, model_type):
    """A 24-token prefill is one product per active expert (at most 4 per layer here), not one per token."""
    save_tiny_model(tmp_path, model_type, seed=1, **FAMILIES[model_type][1])
    llm = LLM(model=str(tmp_path), block_size=8, kv_cache_memory="4MiB")
    moe = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoE)]
    before = [m.expert_products for m in moe]
    llm.generate([random_prompts([24], seed=4)[0]], SamplingParams(max_tokens=1), use_tqdm=False)
    products = [m.expert_products - b for m, b in zip(moe, before)]
    assert moe and all(1 <= p <= m.experts.num_experts for m, p in zip(moe, products))


def test_longrope_prompt_longer_than_original_context(tmp_path):
    """A 52-token prompt (original context 48) runs on the long factors from its first chunk, as transformers'
    prefill does; chunks of 16 cross the switch point mid-prompt."""
    model = save_tiny_model(tmp_path, "phi3", seed=1, **FAMILIES["phi3-longrope"][1])
    prompt = random_prompts([52], seed=5)[0]
    llm = LLM(model=str(tmp_path), block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=16)
    check(llm, [prompt], [reference(model, prompt, MAX_TOKENS)], logprobs=True)


def test_triton_backend_window_and_softcap(tmp_path):
    """Gemma 2 (soft-capped attention) and Gemma 3 (alternating sliding and global layers, per-type RoPE) on the
    Triton kernels (interpreted on CPU) match transformers."""
    pytest.importorskip("triton")
    prompts = random_prompts([19, 30], seed=2)
    for family in ("gemma2", "gemma3"):
        model_type, overrides = FAMILIES[family]
        model = save_tiny_model(tmp_path / family, model_type, seed=1, **overrides)
        llm = LLM(model=str(tmp_path / family), attention_backend="triton", block_size=8, kv_cache_memory="4MiB",
                  max_num_batched_tokens=16)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [out.token_ids for out in outs] == [reference(model, p, 8)[0] for p in prompts], family


def test_generation_config_eos_ids_end_requests(tmp_path):
    """Every id in generation_config.json's eos_token_id list ends a request (config.json names only one)."""
    model = save_tiny_model(tmp_path, "qwen3", seed=1, **FAMILIES["qwen3"][1])
    prompt = random_prompts([7], seed=3)[0]
    tokens = reference(model, prompt, 8)[0]
    stop_at = next(i for i in range(2, 8) if tokens[i] not in tokens[:i] and tokens[i] != model.config.eos_token_id)
    model.generation_config.eos_token_id = [model.config.eos_token_id, tokens[stop_at]]
    model.generation_config.save_pretrained(tmp_path)
    out = LLM(model=str(tmp_path), kv_cache_memory="4MiB").generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[:stop_at + 1]


def test_moe_block_matches_per_token_loop():
    """The grouped experts, unpacked and oneDNN-packed, against a plain loop over tokens and their top-k."""
    torch.manual_seed(0)
    config = tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2)
    moe = SparseMoE(config, 4, 2, config.intermediate_size, normalize=True)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(9, config.hidden_size)
    want = torch.zeros_like(x)
    for t in range(len(x)):
        probs = torch.softmax(moe.gate.weight @ x[t], -1)
        top = probs.topk(2)
        for weight, e in zip(top.values / top.values.sum(), top.indices.tolist()):
            gate_up, down = moe.experts.weights(e)
            gate, up = (gate_up @ x[t]).chunk(2)
            want[t] += weight * (down @ (torch.nn.functional.silu(gate) * up))
    with torch.inference_mode():
        torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)
        if moe.experts.pack_for_cpu():
            torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)
