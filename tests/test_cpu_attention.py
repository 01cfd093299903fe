"""The compiled CPU decode-attention kernel against the pure-torch reference, for every KV storage dtype and
16-bit queries."""
import pytest
import torch

from batchrun.kernels import cpu_attention, quant, reference

FP8 = quant.QUANTIZED_DTYPES["fp8"]


@pytest.fixture(scope="module")
def kernel():
    module = cpu_attention.load()
    if module is None:
        pytest.skip("no C++ toolchain: the engine uses the torch path (tested elsewhere)")
    return module


def random_pool(num_blocks, block_size, kv_heads, head_dim, dtype, seed):
    """(cache, scales) filled with random values, quantized when 8-bit."""
    x = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=torch.Generator().manual_seed(seed)) * 2
    if quant.is_quantized(dtype):
        return quant.quantize(x, dtype)
    return x.to(dtype), None


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, FP8],
                         ids=["float32", "float16", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("block_size,kv_heads,group,head_dim", [(16, 3, 3, 64), (4, 2, 1, 32), (8, 1, 8, 128)])
def test_kernel_matches_reference(kernel, kv_dtype, block_size, kv_heads, group, head_dim):
    lens = [1, 5, block_size, 3 * block_size + 1, 40]
    num_blocks = 64
    k, k_scale = random_pool(num_blocks, block_size, kv_heads, head_dim, kv_dtype, seed=1)
    v, v_scale = random_pool(num_blocks, block_size, kv_heads, head_dim, kv_dtype, seed=2)
    width = max(-(-n // block_size) for n in lens)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))
    tables = torch.zeros(len(lens), width, dtype=torch.long)   # padding points at block 0: must never be read
    used = 0
    for i, n in enumerate(lens):
        need = -(-n // block_size)
        tables[i, :need] = perm[used:used + need]
        used += need
    context_lens = torch.tensor(lens)
    query = torch.randn(len(lens), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(4))
    scale = head_dim ** -0.5
    got = cpu_attention.paged_decode_attention(query, k, v, tables, context_lens, scale, k_scale, v_scale)
    want = reference.paged_decode_attention(query, k, v, tables, context_lens, scale, k_scale, v_scale)
    assert got.shape == want.shape and got.dtype == query.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("kv_dtype", ["same", torch.int8, FP8], ids=["same", "int8", "fp8"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_16bit_query(kernel, dtype, kv_dtype, head_dim):
    """A 16-bit query (the engine's at bf16) is converted once and answered in its own dtype; the reference
    computes in float32 from the same inputs, so the differences are the output's rounding and, for a bfloat16
    cache on AVX512-BF16 CPUs, the probabilities rounded to bfloat16 before they weigh the values. head_dim 80 is
    not a whole number of vectors (masked tails) and takes the float32 path there."""
    kv_dtype = dtype if kv_dtype == "same" else kv_dtype
    k, k_scale = random_pool(16, 16, 2, head_dim, kv_dtype, seed=7)
    v, v_scale = random_pool(16, 16, 2, head_dim, kv_dtype, seed=8)
    tables = torch.randperm(16, generator=torch.Generator().manual_seed(9)).view(4, 4)
    lens = torch.tensor([1, 17, 33, 64])
    query = torch.randn(4, 6, head_dim, generator=torch.Generator().manual_seed(10)).to(dtype)
    got = cpu_attention.paged_decode_attention(query, k, v, tables, lens, head_dim ** -0.5, k_scale, v_scale)
    as_float = (lambda t: t) if quant.is_quantized(kv_dtype) else (lambda t: t.float())
    want = reference.paged_decode_attention(query.float(), as_float(k), as_float(v), tables, lens, head_dim ** -0.5,
                                            k_scale, v_scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=1e-2, atol=1e-2)


def test_padding_rows_are_not_read(kernel):
    """Garbage (NaN) beyond a request's context, in its own last block and in the padding block, changes nothing."""
    k, _ = random_pool(8, 4, 1, 16, torch.float32, seed=5)
    v, _ = random_pool(8, 4, 1, 16, torch.float32, seed=6)
    tables, lens = torch.tensor([[3, 5], [2, 0]]), torch.tensor([6, 3])
    query = torch.randn(2, 2, 16)
    clean = cpu_attention.paged_decode_attention(query, k, v, tables, lens, 0.25)
    k[5, 2:], v[5, 2:], k[2, 3:], k[0], v[0] = float("nan"), float("nan"), float("nan"), float("nan"), float("nan")
    dirty = cpu_attention.paged_decode_attention(query, k, v, tables, lens, 0.25)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean)


@pytest.mark.parametrize("window,softcap", [(None, None), (37, None), (None, 5.0), (20, 3.0)])
@pytest.mark.parametrize("block_size,kv_heads,group,head_dim", [(16, 3, 3, 64), (32, 1, 16, 128), (16, 5, 1, 64)])
def test_bfloat16_pieces_window_softcap(kernel, window, softcap, block_size, kv_heads, group, head_dim):
    """The bfloat16 cache at the shapes the AMX path takes where the CPU has it (16-row pieces, two a step):
    lengths that end inside a piece, on a piece's edge and within the first half of a 32-position step, tables
    exactly as wide as the longest request, a window that starts mid-piece and a softcap, against the float32
    reference; NaN in the unwritten rows of each request's last block changes nothing."""
    lens = [1, 15, 16, 17, 33, 48, 100]
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width
    k, _ = random_pool(num_blocks, block_size, kv_heads, head_dim, torch.bfloat16, seed=11)
    v, _ = random_pool(num_blocks, block_size, kv_heads, head_dim, torch.bfloat16, seed=12)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(13))
    tables = perm.view(len(lens), width)
    context_lens = torch.tensor(lens)
    query = torch.randn(len(lens), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(14)).bfloat16()
    scale = head_dim ** -0.5
    got = cpu_attention.paged_decode_attention(query, k, v, tables, context_lens, scale, window=window,
                                               softcap=softcap)
    want = reference.paged_decode_attention(query.float(), k.float(), v.float(), tables, context_lens, scale,
                                            window=window, softcap=softcap)
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    for i, n in enumerate(lens):
        last_block = tables[i, (n - 1) // block_size]
        k[last_block, (n - 1) % block_size + 1:] = float("nan")
        v[last_block, (n - 1) % block_size + 1:] = float("nan")
    dirty = cpu_attention.paged_decode_attention(query, k, v, tables, context_lens, scale, window=window,
                                                 softcap=softcap)
    torch.testing.assert_close(dirty, got, rtol=0, atol=0)


@pytest.mark.parametrize("lens,kv_heads,threads", [
    ([2400] * 4 + [200] * 28, 3, 2),          # the long requests together at the front
    ([4000] + [100] * 31, 3, 2),              # one request more than a thread's share: split by KV head
    ([50, 900, 7], 2, 2),                     # too few requests for the threads
    ([300, 20, 800, 800, 5, 64, 1000, 2, 90, 400, 33, 700], 1, 3),
])
def test_tasks_are_dealt_out_by_context(kernel, lens, kv_heads, threads):
    """Every (request, part) is one thread's, exactly once, and no thread gets more than 4/3 of the best split's
    most loaded thread (a bound on longest-first dealing): at::parallel_for's contiguous halves of the batch put
    the first lens' long requests all on one thread (1.5x slower)."""
    split, order, offsets = kernel.task_plan(torch.tensor(lens), kv_heads, 0, threads)
    assert split in (1, kv_heads) and len(offsets) == threads + 1
    assert sorted(order) == list(range(len(lens) * split))
    cost = [lens[task // split] / split + 32 for task in order]   # kTaskCost
    loads = [sum(cost[offsets[t]:offsets[t + 1]]) for t in range(threads)]
    best = max(sum(cost) / threads, max(cost))
    assert max(loads) <= 4 / 3 * best + 1e-9
    if lens[0] == 4000:
        assert split == kv_heads


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_same_output_on_any_thread_count(kernel, kv_dtype):
    """However the tasks are dealt out (1-3 threads; whole requests or split by KV head), each request's output is
    the same, bit for bit, and matches the reference."""
    lens = [700, 3, 64, 65, 20] + [9] * 6
    k, _ = random_pool(96, 16, 3, 64, kv_dtype, seed=21)
    v, _ = random_pool(96, 16, 3, 64, kv_dtype, seed=22)
    tables = torch.randint(0, 96, (len(lens), 44), generator=torch.Generator().manual_seed(23))   # blocks may repeat
    query = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(24)).to(kv_dtype)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu_attention.paged_decode_attention(query, k, v, tables, torch.tensor(lens), 0.125))
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
    want = reference.paged_decode_attention(query.float(), k.float(), v.float(), tables, torch.tensor(lens), 0.125)
    torch.testing.assert_close(outs[0].float(), want.to(kv_dtype).float(), rtol=1e-2, atol=1e-2)
