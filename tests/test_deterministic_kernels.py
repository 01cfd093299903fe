"""Deterministic attention kernels: the Triton decode kernel with a fixed KV split (interpreter on CPU) and the CPU
kernel, each against the reference, and a row's output bit-identical whatever rows share its launch."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from batchrun.kernels import cpu_attention, reference  # noqa: E402
from test_kernels import DEVICE, random_block_tables, random_cache, rel_err  # noqa: E402

BLOCK, HEAD_DIM, KV_HEADS, GQA = 16, 64, 2, 4
SPLIT = 32   # small sizes for the interpreter: two splits for the longer rows (the engine's is 512)


def _case(lens, kv_dtype, seed=0):
    k, v, ks, vs = random_cache(48, BLOCK, KV_HEADS, HEAD_DIM, kv_dtype, seed)
    tables = random_block_tables(lens, BLOCK, 48, seed)
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(len(lens), KV_HEADS * GQA, HEAD_DIM, generator=g).to(DEVICE)
    return query, k, v, ks, vs, tables, torch.tensor(lens, device=DEVICE)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_triton_fixed_split_decode_matches_reference_and_ignores_the_batch(kv_dtype):
    pytest.importorskip("triton")
    from batchrun.kernels import paged_attention
    lens = [70, 9, 33, 64]
    query, k, v, ks, vs, tables, context = _case(lens, kv_dtype)

    def attend(rows, window=None):
        return paged_attention.paged_decode_attention(query[rows], k, v, tables[rows], context[rows], 0.125, ks, vs,
                                                      split_len=SPLIT, block_n=BLOCK, window=window)
    every = list(range(len(lens)))
    ref = reference.paged_decode_attention(query, k, v, tables, context, 0.125, ks, vs)
    out = attend(every)
    assert rel_err(out, ref) < 1e-5
    for i in every:   # alone: a one-split grid for the short rows, yet the same bits
        assert torch.equal(attend([i])[0], out[i]), f"row {i} alone"
    assert torch.equal(attend([3, 1])[1], out[1]), "another neighbour and order"
    windowed = attend(every, window=20)
    assert rel_err(windowed, reference.paged_decode_attention(query, k, v, tables, context, 0.125, ks, vs,
                                                              window=20)) < 1e-5
    assert torch.equal(attend([0], window=20)[0], windowed[0])


def test_triton_split_len_must_be_a_multiple_of_the_key_tile():
    pytest.importorskip("triton")
    from batchrun.kernels import paged_attention
    query, k, v, ks, vs, tables, context = _case([20], torch.float32)
    with pytest.raises(ValueError, match="split_len 24 is not a multiple of block_n 16"):
        paged_attention.paged_decode_attention(query, k, v, tables, context, 0.125, split_len=24, block_n=16)


@pytest.mark.skipif(DEVICE != "cpu" or cpu_attention.load() is None, reason="the CPU kernel is not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_rows_as_prefill_queries_match_reference_and_each_other(dtype):
    """Deterministic prefill runs a chunk's queries through the decode kernel, one context length per row."""
    lens = [40, 41, 42, 43]   # the last four positions of one 43-token request
    query, k, v, ks, vs, tables, context = _case([43] * 4, torch.bfloat16)
    tables, context, query = tables[:1].expand(4, -1).contiguous(), torch.tensor(lens), query.to(dtype)
    out = cpu_attention.paged_decode_attention(query, k, v, tables, context, 0.125)
    ref = reference.paged_prefill_attention(query, k, v, tables[0], 43, 0.125)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    for i in range(4):
        alone = cpu_attention.paged_decode_attention(query[i:i + 1], k, v, tables[i:i + 1], context[i:i + 1], 0.125)
        assert torch.equal(alone[0], out[i])
