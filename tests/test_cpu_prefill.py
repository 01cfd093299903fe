"""The CPU prefill-attention kernels (batchrun/kernels/cpu_prefill.h: bfloat16 on AVX512-BF16, float32 on AVX-512;
cpu_prefill_amx.h: bfloat16 on AMX tiles) against the float32 reference: a chunk of one request's rows over its paged
context, with and without a cached prefix, a window and a softcap. Each path runs where the CPU has it."""
import pytest
import torch

from batchrun.kernels import cpu_attention, reference


@pytest.fixture(scope="module")
def kernel():
    module = cpu_attention.load()
    if module is None:
        pytest.skip("no C++ toolchain: prefill chunks run on torch's SDPA")
    return module


PATHS = {"bf16-vector": (torch.bfloat16, False), "bf16-tiles": (torch.bfloat16, True),
         "f32-vector": (torch.float32, False)}


@pytest.fixture(params=list(PATHS))
def path(request, kernel):
    """(dtype, tiles) of one of the kernel's paths, where this CPU runs it."""
    dtype, tiles = PATHS[request.param]
    if not kernel.prefill_ready(dtype == torch.bfloat16) or (tiles and not kernel.prefill_amx_ready()):
        pytest.skip(f"{request.param}: not on this CPU (AVX512-BF16, AVX-512 or AMX-BF16 missing)")
    return dtype, tiles


def tolerance(dtype):
    """bfloat16: the output's rounding and P's; float32: summation order and exp_u20's 20 ulp."""
    return dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)


def paged(context_len, block_size, kv_heads, head_dim, seed, dtype=torch.bfloat16):
    """(k, v, block_table): a pool of twice the blocks needed, the request's blocks shuffled across it, the rows
    after its context in its last block NaN (never written)."""
    width = -(-context_len // block_size)
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(2 * width, block_size, kv_heads, head_dim, generator=gen) * 2).to(dtype)
    v = (torch.randn(2 * width, block_size, kv_heads, head_dim, generator=gen) * 2).to(dtype)
    table = torch.randperm(2 * width, generator=gen)[:width]
    tail = (context_len - 1) % block_size + 1
    k[table[-1], tail:] = float("nan")
    v[table[-1], tail:] = float("nan")
    return k, v, table


@pytest.mark.parametrize("rows,context_len", [(1, 1), (17, 17), (40, 100), (355, 355), (33, 1000), (64, 64)])
@pytest.mark.parametrize("block_size,kv_heads,group,head_dim", [(16, 3, 3, 64), (32, 1, 16, 128), (16, 2, 1, 64)])
def test_prefill_matches_reference(path, rows, context_len, block_size, kv_heads, group, head_dim):
    dtype, tiles = path
    k, v, table = paged(context_len, block_size, kv_heads, head_dim, seed=rows + context_len, dtype=dtype)
    query = torch.randn(rows, kv_heads * group, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = head_dim ** -0.5
    got = cpu_attention.paged_prefill_attention(query, k, v, table, context_len, scale, tiles=tiles)
    want = reference.paged_prefill_attention(query.float(), k.float(), v.float(), table, context_len, scale)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.to(dtype).float(), **tolerance(dtype))


@pytest.mark.parametrize("window,softcap", [(37, None), (None, 5.0), (20, 3.0), (1, None)])
@pytest.mark.parametrize("rows,context_len", [(50, 50), (30, 130)])
def test_prefill_window_and_softcap(path, window, softcap, rows, context_len):
    dtype, tiles = path
    k, v, table = paged(context_len, 16, 3, 64, seed=7, dtype=dtype)
    query = torch.randn(rows, 9, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = cpu_attention.paged_prefill_attention(query, k, v, table, context_len, 0.125, window, softcap, tiles)
    want = reference.paged_prefill_attention(query.float(), k.float(), v.float(), table, context_len, 0.125,
                                             window=window, softcap=softcap)
    torch.testing.assert_close(got.float(), want.to(dtype).float(), **tolerance(dtype))


def test_prefill_same_output_on_any_thread_count(path):
    """Tasks (16 rows with all their heads, or one head) are dealt out by the positions they read; each row's
    output is the same bit for bit however many threads share them."""
    dtype, tiles = path
    k, v, table = paged(300, 16, 3, 64, seed=3, dtype=dtype)
    query = torch.randn(200, 9, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu_attention.paged_prefill_attention(query, k, v, table, 300, 0.125, tiles=tiles))
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_engine_prefills_chunks_on_the_kernel(kernel, dtype, tmp_path, monkeypatch):
    """An engine with a head_dim of 64: its prefill chunks (up to a 24-token budget, each after the chunks before it)
    run on the kernel, and the prompts' log-probabilities are as close to transformers' float32 ones as those of the
    path before it (SDPA, over a gathered copy after the first chunk)."""
    if not kernel.prefill_ready(dtype == "bfloat16"):
        pytest.skip(f"{dtype} prefill kernel: not on this CPU")
    from batchrun import LLM, SamplingParams
    from conftest import random_prompts, save_tiny_model
    from test_prompt_logprobs import reference_prompt_logprobs
    model = save_tiny_model(tmp_path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    prompts = random_prompts([70, 45, 9], seed=8)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=True)
    calls = []
    real = cpu_attention.paged_prefill_attention
    monkeypatch.setattr(cpu_attention, "paged_prefill_attention",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))

    def error(in_place: bool) -> float:
        """The largest difference from the float32 reference's prompt log-probabilities."""
        monkeypatch.setattr(cpu_attention, "prefill_supported", lambda q, k: in_place and q.dtype == k.dtype)
        llm = LLM(model=str(tmp_path), dtype=dtype, block_size=16, max_num_batched_tokens=24,
                  kv_cache_memory="8MiB")
        outs = llm.generate(prompts, params, use_tqdm=False)
        return max(float((torch.tensor(out.prompt_logprobs[1:]) - torch.tensor(reference_prompt_logprobs(model, p)))
                         .abs().max()) for out, p in zip(outs, prompts))

    before = error(False)
    assert not calls
    after = error(True)
    assert calls and max(calls) == 24   # every chunk (up to the 24-token budget), on every layer
    assert after <= 1.5 * before + (0.02 if dtype == "bfloat16" else 1e-4), (after, before)
