"""Triton kernels against the pure-torch reference, on fresh random inputs; on CPU under TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set before batchrun.kernels' Triton modules are
imported. A covering subset of block size x head_dim x GQA x KV dtype, not the full cross product.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from batchrun.kernels import cache_write, paged_attention, quant, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = quant.QUANTIZED_DTYPES["fp8"]
KV_DTYPES = {"float16": torch.float16, "int8": torch.int8, "fp8": FP8}
MAX_REL_ERR = 1e-3
KV_HEADS = 2
# (block_size, head_dim, gqa, kv dtype): every value of each axis, each pair of block size and head_dim
CASES = [(16, 64, 1, "float16"), (16, 128, 4, "int8"), (32, 64, 8, "fp8"), (32, 128, 1, "int8"),
         (16, 64, 8, "int8"), (32, 128, 4, "float16"), (16, 128, 1, "fp8"), (32, 64, 4, "fp8"),
         (16, 64, 4, "float16")]
CASE_IDS = [f"bs{b}-d{d}-gqa{g}-{t}" for b, d, g, t in CASES]


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_cache(num_blocks, block_size, kv_heads, head_dim, kv_dtype, seed=0):
    """(k, v, k_scale, v_scale) filled with random values (quantized when 8-bit)."""
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(2):
        x = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
        if quant.is_quantized(kv_dtype):
            codes, scales = quant.quantize(x * 3, kv_dtype)
            caches.append((codes.to(DEVICE), scales.to(DEVICE)))
        else:
            caches.append((x.to(kv_dtype).to(DEVICE), None))
    (k, k_scale), (v, v_scale) = caches
    return k, v, k_scale, v_scale


def random_block_tables(lens, block_size, num_blocks, seed=0):
    """Disjoint random blocks per request, padded with block 0, [B, max_blocks]."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used:used + n]
        used += n
    return tables.to(DEVICE)


@pytest.mark.parametrize("kv_name", list(KV_DTYPES))
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128)])
def test_cache_write_matches_reference(kv_name, block_size, head_dim):
    kv_dtype, num_blocks, tokens = KV_DTYPES[kv_name], 6, 37
    g = torch.Generator().manual_seed(1)
    # key/value as the model makes them: views into one fused projection (strided token dimension)
    fused = torch.randn(tokens, 3, KV_HEADS, head_dim, generator=g).to(torch.float16).to(DEVICE)
    fused[0, 1] = 0.0                                   # an all-zero row
    fused[1, 1, :, 0] = 6e4                             # one huge value beside small ones
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[3, 20]] = -1                                 # padding rows are skipped
    results = []
    for write in (reference.write_kv_cache, cache_write.write_kv_cache):
        poison = torch.full((num_blocks, block_size, KV_HEADS, head_dim), -3.0)
        k, v = poison.to(kv_dtype).to(DEVICE), poison.to(kv_dtype).to(DEVICE)
        scales = [torch.full((num_blocks, block_size, KV_HEADS), float("nan"), device=DEVICE) for _ in range(2)]
        scales = scales if quant.is_quantized(kv_dtype) else [None, None]
        write(key, value, k, v, slots.to(DEVICE), *scales)
        results.append((k, v, *scales))
    for ref, got in zip(*results):
        if ref is not None:
            assert torch.equal(ref.float().nan_to_num(7.0), got.float().nan_to_num(7.0))


def test_cache_write_rounds_fp8_ties_to_even():
    """Values halfway between fp8 codes, in the normal and the subnormal range, round as torch rounds them."""
    row = torch.tensor([448.0, 17.0, 19.0, 31.0, 4.25, 4.75, 272.0, 304.0, 440.0, 2.0 ** -9 * 1.5, 2.0 ** -9 * 2.5,
                        -17.0, -31.0, 1.0, 1.0, 1.0])   # 31 -> 32 and 440 -> 448 carry into the exponent
    key = torch.stack([row, -row])[:, None, :].to(DEVICE)   # [2, 1, 16], scale exactly 1
    caches = []
    for write in (reference.write_kv_cache, cache_write.write_kv_cache):
        k, v = (torch.zeros(1, 2, 1, 16, dtype=FP8, device=DEVICE) for _ in range(2))
        ks, vs = (torch.zeros(1, 2, 1, device=DEVICE) for _ in range(2))
        write(key, key, k, v, torch.arange(2, device=DEVICE), ks, vs)
        caches.append(k.float())
    assert torch.equal(*caches)


def decode_inputs(block_size, head_dim, gqa, kv_name, lens, seed=0):
    kv_dtype = KV_DTYPES[kv_name]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k, v, k_scale, v_scale = random_cache(num_blocks, block_size, KV_HEADS, head_dim, kv_dtype, seed)
    tables = random_block_tables(lens, block_size, num_blocks, seed)
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(len(lens), KV_HEADS * gqa, head_dim, generator=g).to(torch.float16).to(DEVICE)
    return query, k, v, k_scale, v_scale, tables, torch.tensor(lens, device=DEVICE)


@pytest.mark.parametrize("block_size,head_dim,gqa,kv_name", CASES, ids=CASE_IDS)
def test_decode_matches_reference(block_size, head_dim, gqa, kv_name):
    lens = [1, 45, block_size * 3 + 7, 130]   # ragged: not multiples of the block size
    query, k, v, k_scale, v_scale, tables, context_lens = decode_inputs(block_size, head_dim, gqa, kv_name, lens)
    scale = head_dim ** -0.5
    ref = reference.paged_decode_attention(query.float(), k, v, tables, context_lens, scale, k_scale, v_scale)
    for num_splits in (1, 3):   # 3 splits of 64 tokens: some empty for short requests
        out = torch.full_like(query, float("nan"))
        paged_attention.paged_decode_attention(query, k, v, tables, context_lens, scale, k_scale, v_scale,
                                               num_splits=num_splits, out=out)
        assert not out.isnan().any(), f"unwritten or NaN output with {num_splits} splits"
        assert rel_err(out, ref) < MAX_REL_ERR, f"{num_splits} splits"


def test_decode_float32_query():
    lens = [9, 70]
    query, k, v, k_scale, v_scale, tables, context_lens = decode_inputs(16, 64, 4, "int8", lens, seed=3)
    query = query.float()
    ref = reference.paged_decode_attention(query, k, v, tables, context_lens, 0.125, k_scale, v_scale)
    out = paged_attention.paged_decode_attention(query, k, v, tables, context_lens, 0.125, k_scale, v_scale)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-5


def test_choose_num_splits():
    assert paged_attention.choose_num_splits(64, 8, 4096, 132) == 1          # enough programs already
    assert paged_attention.choose_num_splits(2, 8, 300, 132) == 1            # too short to split
    splits = paged_attention.choose_num_splits(2, 8, 32768, 132)
    assert splits > 1 and splits & (splits - 1) == 0 and 32768 // splits >= paged_attention.SPLIT_MIN_TOKENS


@pytest.mark.parametrize("block_size,head_dim,gqa,kv_name", CASES, ids=CASE_IDS)
def test_varlen_prefill_matches_reference(block_size, head_dim, gqa, kv_name):
    # (chunk length, context length): whole prompt, chunk after a cached prefix, a decode row (mixed batch),
    # a chunk spanning several query tiles
    chunks = [(23, 23), (9, 9 + block_size + 5), (1, 50), (40, 61)]
    query_lens, lens = [c[0] for c in chunks], [c[1] for c in chunks]
    _, k, v, k_scale, v_scale, tables, context_lens = decode_inputs(block_size, head_dim, gqa, kv_name, lens)
    g = torch.Generator().manual_seed(5)
    query = torch.randn(sum(query_lens), KV_HEADS * gqa, head_dim, generator=g).to(torch.float16).to(DEVICE)
    starts = torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).to(torch.int32)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    paged_attention.paged_prefill_attention(query, k, v, tables, starts, context_lens.to(torch.int32), scale,
                                            k_scale, v_scale, out=out)
    ref = torch.cat([reference.paged_prefill_attention(query[starts[r]:starts[r + 1]].float(), k, v, tables[r],
                                                       lens[r], scale, k_scale, v_scale) for r in range(len(chunks))])
    assert not out.isnan().any()
    assert rel_err(out, ref) < MAX_REL_ERR


def test_large_block_count_uses_64bit_offsets():
    """Blocks past 2**31 elements of the pool: int32 offset arithmetic would wrap and read or write elsewhere.
    The pool is allocated, not filled: only the blocks used are ever touched."""
    block_size, head_dim, kv_heads = 16, 64, 1
    num_blocks = 2 ** 31 // (block_size * head_dim) + 64
    k = torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=torch.int8, device=DEVICE)
    v = torch.empty_like(k)
    k_scale = torch.empty(num_blocks, block_size, kv_heads, device=DEVICE)
    v_scale = torch.empty_like(k_scale)
    lens = [40, 25]
    tables = torch.tensor([[num_blocks - 1, 5, num_blocks - 40], [num_blocks - 7, num_blocks - 2, 0]],
                          device=DEVICE)
    slots = torch.cat([(tables[b, :-(-n // block_size), None] * block_size + torch.arange(block_size, device=DEVICE)
                        ).flatten()[:n] for b, n in enumerate(lens)])
    g = torch.Generator().manual_seed(7)
    key, value = (torch.randn(len(slots), kv_heads, head_dim, generator=g).to(DEVICE) for _ in range(2))
    cache_write.write_kv_cache(key, value, k, v, slots, k_scale, v_scale)
    stored = k.view(-1, kv_heads, head_dim)[slots].float() * k_scale.view(-1, kv_heads)[slots][..., None]
    assert rel_err(stored, key) < 1e-2
    query = torch.randn(2, kv_heads * 4, head_dim, generator=g).to(DEVICE)
    context_lens = torch.tensor(lens, device=DEVICE)
    ref = reference.paged_decode_attention(query, k, v, tables, context_lens, 0.125, k_scale, v_scale)
    out = paged_attention.paged_decode_attention(query, k, v, tables, context_lens, 0.125, k_scale, v_scale)
    assert rel_err(out, ref) < MAX_REL_ERR
    starts = torch.tensor([0, 40, 65], device=DEVICE)
    q = torch.randn(65, kv_heads * 4, head_dim, generator=g).to(DEVICE)
    out = paged_attention.paged_prefill_attention(q, k, v, tables, starts, context_lens, 0.125, k_scale, v_scale)
    ref = torch.cat([reference.paged_prefill_attention(q[:40], k, v, tables[0], 40, 0.125, k_scale, v_scale),
                     reference.paged_prefill_attention(q[40:], k, v, tables[1], 25, 0.125, k_scale, v_scale)])
    assert rel_err(out, ref) < MAX_REL_ERR


def test_bench_byte_counts():
    from batchrun.gpucheck import kernel_bench as bench
    shape = bench.DecodeShape()   # the issue's: batch 64, context 4096, head_dim 128, 8 KV heads
    assert bench.kv_bytes_read(shape, "float16") == 2 * 64 * 4096 * 8 * 128 * 2 == 2 ** 30
    assert bench.kv_bytes_read(shape, "int8") == bench.kv_bytes_read(shape, "fp8") == 2 * 64 * 4096 * 8 * (128 + 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_bench_refuses_without_cuda():
    from batchrun.gpucheck import kernel_bench as bench
    with pytest.raises(SystemExit, match="needs|CUDA"):
        bench.main([])


def test_bench_dry_run(tmp_path, capsys):
    from batchrun.gpucheck import kernel_bench as bench
    result = bench.main(["--dry-run", "--skip-e2e", "--json", str(tmp_path / "out.json")])
    assert [r["kv_dtype"] for r in result["decode"]] == list(bench.KV_NAMES)
    for r in result["decode"]:
        assert r["rel_err"] < MAX_REL_ERR and r["ms"] > 0 and r["torch_ms"] > 0
        assert r["bytes_read"] == bench.kv_bytes_read(bench.DRY_RUN_SHAPE, r["kv_dtype"])
    assert "DRY RUN" in capsys.readouterr().out and (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_bench_dry_run_end_to_end(tiny_model):
    from batchrun.gpucheck import kernel_bench as bench
    result = bench.main(["--dry-run", "--model", tiny_model[0], "--kv-cache-memory", "4MiB", "--e2e-prompts", "2",
                         "--e2e-max-tokens", "2", "--hf-batch-size", "2"])
    assert [r["engine_tokens"] for r in result["e2e"]] == [4, 4] and [r["hf_tokens"] for r in result["e2e"]] == [4, 4]
