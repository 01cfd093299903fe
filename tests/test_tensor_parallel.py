"""Tensor parallelism over 2 ranks (gloo on the CPU) against the same engine on one rank, float32 tiny models:
greedy tokens identical and chosen-token logprobs within 1e-4, through chunked prefill, prefix caching, forced
preemption, an int8 KV pool, n > 1 and structured outputs; the family kinds the split handles (GQA, MoE experts, KV
heads replicated over ranks; per-head q/k norms and soft-caps marked slow); sharded loading reads only a rank's
slices; bad splits fail with the field named. The worker ranks run eager (BATCHRUN_COMPILE=0 at their start):
compiling each worker's kernels would cost seconds per engine; bench/tp.py runs every rank's whole-model graph,
with the all-reduce as an opaque op inside it (tokens identical to TP 1)."""
import multiprocessing
from types import SimpleNamespace

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.engine import loader
from batchrun.models.llama import LlamaForCausalLM
from batchrun.engine.parallel.shard import Shard, check
from batchrun.engine.request import RequestOutput
from conftest import random_prompts, save_tiny_model

# Pools sized so that TP 1 and TP 2 (half the KV heads per rank, half the bytes per token) get the same number of
# blocks: the batch lane (total less the interactive share) preempts, the interactive lane stores int8.
POOLS = dict(block_size=4, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=6, interactive_lane=True,
             interactive_kv_cache_dtype="int8")
TP1_KV, TP2_KV = dict(kv_cache_memory="104KiB", interactive_kv_memory="40KiB"), dict(
    kv_cache_memory="52KiB", interactive_kv_memory="20KiB")


def start(path, tp: int, **options) -> LLM:
    """An LLM; its worker ranks (tp > 1) start eager."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHRUN_COMPILE", "0")
        return LLM(model=path, tensor_parallel_size=tp, **options)


@pytest.fixture(scope="class")
def pair(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tp-llama"))
    save_tiny_model(path, "llama", seed=3)
    one, two = start(path, 1, **POOLS, **TP1_KV), start(path, 2, **POOLS, **TP2_KV)
    yield one, two
    two.close()


def same(a, b, tol=1e-4):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < tol


GREEDY = SamplingParams(max_tokens=20, temperature=0, logprobs=True, ignore_eos=True)


class TestOneEnginePair:
    """One TP 1 and one TP 2 engine for these (a process runs one tensor-parallel engine at a time)."""

    def test_greedy_with_chunked_prefill_and_preemption(self, pair):
        one, two = pair
        assert two.engine.num_blocks == one.engine.num_blocks
        assert two.engine.model.model.layers[0].self_attn.num_kv_heads == 1   # each rank its half of the KV heads
        prompts = random_prompts([5, 30, 17, 40, 9, 26], seed=4)   # longer than 16: prefilled in chunks
        before = two.engine.stats.preemptions
        same(one.generate(prompts, GREEDY, use_tqdm=False), two.generate(prompts, GREEDY, use_tqdm=False))
        assert two.engine.stats.preemptions > before   # 6 x ~50 tokens do not fit 128 tokens of KV


    def test_prefix_caching(self, pair):
        one, two = pair
        prefix = random_prompts([24], seed=5)[0]
        prompts = [prefix + tail for tail in random_prompts([3, 6], seed=6)]
        hits = two.engine.stats.prefix_cache_hit_tokens
        for _ in range(2):
            same(one.generate(prompts, GREEDY, use_tqdm=False), two.generate(prompts, GREEDY, use_tqdm=False))
        assert two.engine.stats.prefix_cache_hit_tokens > hits


    def test_int8_kv_lane(self, pair):
        one, two = pair
        prompts = random_prompts([12, 33], seed=7)
        outs = []
        for llm in pair:
            requests = [llm.engine.add_request(p, GREEDY, lane="interactive") for p in prompts]
            while llm.engine.has_unfinished():
                llm.engine.step()
            outs.append([RequestOutput.of(r) for r in requests])
        same(*outs)


    def test_n_samples_and_seeds(self, pair):
        one, two = pair
        params = SamplingParams(n=3, max_tokens=10, temperature=0.8, seed=11, logprobs=True)
        a, b = (llm.generate(random_prompts([14, 21], seed=8), params, use_tqdm=False) for llm in pair)
        assert len(a) == 6 and len({tuple(o.token_ids) for o in a}) > 2   # n samples per prompt, not all alike
        same(a, b)


    def test_structured_outputs(self, pair):
        params = [SamplingParams(max_tokens=12, temperature=0, choice=["yes", "no", "maybe so"]),
                  SamplingParams(max_tokens=16, temperature=0.7, seed=2, regex=r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)")]
        a, b = ([llm.generate("Is it?", p, use_tqdm=False)[0].text for p in params] for llm in pair)
        assert a == b and a[0] in ("yes", "no", "maybe so")


FAMILIES = {
    "qwen3-head-norm": ("qwen3", dict(head_dim=16)),
    "llama-kv-replicated": ("llama", dict(num_key_value_heads=1)),
    "mixtral-experts": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma2-softcaps": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                                       final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
                                       sliding_window=12, layer_types=["sliding_attention", "full_attention"])),
}


# Qwen3's per-head norms are replicated like Llama's layers (the pair above); Gemma 2 adds only elementwise caps.
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f.startswith(("gemma", "qwen3"))
                                    else f for f in FAMILIES])
def test_families(family, tmp_path):
    model_type, overrides = FAMILIES[family]
    save_tiny_model(tmp_path, model_type, seed=1, **overrides)
    prompts = random_prompts([7, 25, 18], seed=9)
    options = dict(block_size=4, max_num_batched_tokens=16, kv_cache_memory="1MiB")
    outs = []
    for tp in (1, 2):
        llm = start(str(tmp_path), tp, **options)
        outs.append(llm.generate(prompts, GREEDY, use_tqdm=False))
        llm.close()
    same(*outs)


def test_sharded_loading_reads_each_rank_slices(tmp_path, monkeypatch):
    """Each rank's tensors are its slices of the checkpoint's, per part of the fused q/k/v and gate/up, about half
    of its numbers; a slice along columns reads rows in chunks (a tiny chunk size here)."""
    full = save_tiny_model(tmp_path, "llama", seed=2).state_dict()
    monkeypatch.setattr(loader.SafetensorsReader, "SLICE_CHUNK_BYTES", 100)
    layer = "model.layers.0."
    for rank in range(2):
        with torch.device("meta"):
            model = LlamaForCausalLM(loader.load_config(str(tmp_path)), None)
        shard = Shard(rank, 2)
        shard.split(model)
        weights = loader.load_weights(str(tmp_path), torch.device("cpu"), torch.float32, model.checkpoint_plan,
                                      part=shard.part)
        model.load_state_dict(weights, assign=True)   # every shape is the split model's
        heads, kv, inter = slice(32 * rank, 32 * (rank + 1)), slice(16 * rank, 16 * (rank + 1)), slice(
            64 * rank, 64 * (rank + 1))
        p = lambda name: full[layer + name]   # noqa: E731
        assert torch.equal(weights[layer + "self_attn.qkv_proj.weight"], torch.cat(
            [p("self_attn.q_proj.weight")[heads], p("self_attn.k_proj.weight")[kv], p("self_attn.v_proj.weight")[kv]]))
        assert torch.equal(weights[layer + "self_attn.o_proj.weight"], p("self_attn.o_proj.weight")[:, heads])
        assert torch.equal(weights[layer + "mlp.gate_up_proj.weight"], torch.cat(
            [p("mlp.gate_proj.weight")[inter], p("mlp.up_proj.weight")[inter]]))
        assert torch.equal(weights[layer + "mlp.down_proj.weight"], p("mlp.down_proj.weight")[:, inter])
        assert torch.equal(weights["lm_head.weight"], full["lm_head.weight"][128 * rank:128 * (rank + 1)])
        assert torch.equal(weights[layer + "input_layernorm.weight"], p("input_layernorm.weight"))
        numbers = sum(t.numel() for t in weights.values())
        assert numbers < 0.52 * sum(t.numel() for t in full.values())


def test_bad_splits_fail_naming_the_field(tmp_path):
    def config(heads, kv, vocab=256):
        return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check(config(6, 2), 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check(config(12, 3), 2)
    with pytest.raises(ValueError, match="vocab_size"):
        check(config(4, 2, 255), 2)
    check(config(8, 2), 8)   # 2 KV heads, each on 4 ranks
    with pytest.raises(ValueError, match="already fused"):   # Phi-3's checkpoint: q/k/v rows of a rank are 3 runs
        Shard(0, 2).part("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj.weight",
                         [192, 64])
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model="smollm2-135m", tensor_parallel_size=0)
    # not yet combined: refused by name before any rank starts
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 ranks with quantization 'int8' is not supported"):
        LLM(model="smollm2-135m", tensor_parallel_size=2, quantization="int8")
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 ranks with LoRA adapters is not supported"):
        LLM(model="smollm2-135m", tensor_parallel_size=2, adapters={"a": str(tmp_path)})


def test_olmo2_full_qk_norm_refused_and_workers_stopped(tmp_path):
    save_tiny_model(tmp_path, "olmo2", seed=1)
    with pytest.raises(ValueError, match="OLMo 2"):
        start(str(tmp_path), 2, kv_cache_memory="1MiB")
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("batchrun-tp")]
