"""Decode over a prefix that several requests share (engine/shared_prefix.py): which prefixes are found, the two
kernel parts and their merge against the float32 reference, and the engine's tokens with and without it."""
import pytest
import torch

from batchrun.engine import shared_prefix
from batchrun.engine.shared_prefix import find_shared_prefixes
from batchrun.kernels import cpu_attention, reference


def test_finds_the_blocks_all_sharers_have_in_common():
    common = list(range(20))   # 320 positions at block size 16
    tables = [common + [100 + i] for i in range(8)] + [[50, 51]] + [common[:10] + [200]]
    lens = [320 + 5] * 8 + [20, 170]
    prefixes, starts = find_shared_prefixes(tables, lens, 16, torch.device("cpu"))
    # the tenth request shares only its first 10 blocks: the nine from block 0 share 160 positions, under the
    # minimum, so none qualifies; without it the eight share all 20 blocks
    assert prefixes == [] and starts is None
    prefixes, starts = find_shared_prefixes(tables[:9], lens[:9], 16, torch.device("cpu"))
    assert len(prefixes) == 1
    assert prefixes[0].rows.tolist() == list(range(8)) and prefixes[0].length == 320
    assert prefixes[0].block_table.tolist() == common
    assert starts.tolist() == [320] * 8 + [0]


def test_each_request_keeps_its_last_position():
    """A request whose context ends at the end of a shared block reads that block's last position on its own."""
    common = list(range(17))
    tables = [common] * 8
    prefixes, starts = find_shared_prefixes(tables, [17 * 16] * 8, 16, torch.device("cpu"))
    assert prefixes[0].length == 16 * 16 and starts.tolist() == [256] * 8


def test_too_few_sharers_or_positions_find_nothing():
    tables = [list(range(40)) + [100 + i] for i in range(shared_prefix.MIN_REQUESTS - 1)]
    assert find_shared_prefixes(tables, [41 * 16] * len(tables), 16, torch.device("cpu")) == ([], None)
    tables = [list(range(3)) + [100 + i] for i in range(16)]
    assert find_shared_prefixes(tables, [60] * 16, 16, torch.device("cpu")) == ([], None)


@pytest.fixture(params=[torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def dtype(request):
    module = cpu_attention.load()
    if module is None or not module.prefill_ready(request.param == torch.bfloat16):
        pytest.skip(f"{request.param} prefill kernel: not on this CPU or no C++ toolchain")
    return request.param


@pytest.mark.parametrize("head_dim,kv_heads,group", [(64, 3, 3), (128, 2, 4)])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_parts_merge_into_the_reference(dtype, head_dim, kv_heads, group, softcap):
    """n requests after a 5-block prefix they share, each with its own 1-40 positions (in blocks shuffled across the
    pool): prefix part + own part, merged, equal the float32 reference over each whole context."""
    gen = torch.Generator().manual_seed(head_dim + int(softcap or 0))
    block_size, prefix_blocks, own = 16, 5, [1, 3, 16, 17, 40, 29]
    pool = 64
    k = (torch.randn(pool, block_size, kv_heads, head_dim, generator=gen) * 2).to(dtype)
    v = (torch.randn(pool, block_size, kv_heads, head_dim, generator=gen) * 2).to(dtype)
    order = torch.randperm(pool, generator=gen).tolist()
    prefix, rest = order[:prefix_blocks], order[prefix_blocks:]
    tables, lens = [], []
    for n in own:
        mine, rest = rest[:-(-n // block_size)], rest[-(-n // block_size):]
        tables.append(prefix + mine)
        lens.append(prefix_blocks * block_size + n)
    width = max(map(len, tables))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens = torch.tensor(lens)
    query = torch.randn(len(own), kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    expected = reference.paged_decode_attention(query.float(), k.float(), v.float(), tables, lens, scale, None, None,
                                                int(lens.max()), None, None, softcap)
    starts = torch.full((len(own),), prefix_blocks * block_size)
    own_part, own_lse = cpu_attention.decode_attention_from(query, k, v, tables, lens, starts, scale, softcap)
    shared_part, shared_lse = cpu_attention.shared_prefix_attention(query, k, v, torch.tensor(prefix),
                                                                    prefix_blocks * block_size, scale, softcap)
    merged = cpu_attention.merge_parts(shared_part, shared_lse, own_part, own_lse)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged.float(), expected, **tol)


def test_a_request_with_nothing_of_its_own_is_refused(dtype):
    k = torch.zeros(4, 16, 1, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match="at least one position"):
        cpu_attention.decode_attention_from(torch.zeros(1, 1, 64, dtype=dtype), k, k, torch.tensor([[0, 1]]),
                                            torch.tensor([32]), torch.tensor([32]), 0.125)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_the_engine_reads_a_shared_prefix_once(dtype_name, tmp_path, monkeypatch):
    """Ten requests after a 300-token prompt prefix, cached by a first request: their decodes read the prefix's 18
    blocks once a layer for all of them, and give the tokens of the path that reads the prefix per request (float32;
    bfloat16: token log-probabilities as close to float32's as that path's)."""
    module = cpu_attention.load()
    if module is None or not module.prefill_ready(dtype_name == "bfloat16"):
        pytest.skip(f"{dtype_name} prefill kernel: not on this CPU or no C++ toolchain")
    from batchrun import LLM, SamplingParams
    from conftest import random_prompts, save_tiny_model
    save_tiny_model(tmp_path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    common = random_prompts([300], seed=3)[0]
    prompts = [common + own for own in random_prompts([5 + 3 * i for i in range(10)], seed=4)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
    calls = []
    real = cpu_attention.shared_prefix_attention
    monkeypatch.setattr(cpu_attention, "shared_prefix_attention",
                        lambda *a, **kw: calls.append((a[0].shape[0], a[4])) or real(*a, **kw))

    def run(apart: bool, dtype: str = dtype_name):
        monkeypatch.setattr(shared_prefix, "MIN_REQUESTS", 8 if apart else 10 ** 9)
        llm = LLM(model=str(tmp_path), dtype=dtype, block_size=16, kv_cache_memory="16MiB")
        llm.generate([common + [7]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)   # caches it
        return llm.generate(prompts, params, use_tqdm=False)

    per_request = run(False)
    assert not calls
    shared = run(True)
    assert calls and all(rows == 10 and length == 288 for rows, length in calls), calls[:3]
    if dtype_name == "float32":
        assert [o.token_ids for o in shared] == [o.token_ids for o in per_request]
        for a, b in zip(shared, per_request):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
        return
    # bfloat16: the two paths round differently (on AMX the per-request decode runs on tiles, the shared one on
    # vectors and the prefill kernel), so each is held to float32 over the tokens both still share with it
    exact = run(False, "float32")
    assert max_logprob_error(shared, exact) <= 1.5 * max_logprob_error(per_request, exact) + 0.02


def max_logprob_error(outputs, exact) -> float:
    """The largest |log-probability - exact's| over each output's tokens up to where it leaves exact's tokens."""
    worst = 0.0
    for out, ref in zip(outputs, exact):
        for token, logprob, ref_token, ref_logprob in zip(out.token_ids, out.logprobs, ref.token_ids, ref.logprobs):
            if token != ref_token:
                break
            worst = max(worst, abs(logprob - ref_logprob))
    return worst
