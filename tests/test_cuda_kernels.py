"""The Triton kernels against the pure-torch reference on CUDA, where the interpreter's tests cannot go: their
cases (block size x head_dim x GQA x KV dtype, from test_kernels.py) crossed with full attention and each window /
soft-cap setting of test_sliding_window_kernels.py, contexts up to 4,100 tokens, the CUDA tile sizes (64) and the
split count chosen for the device. (On CUDA, test_kernels.py and test_sliding_window_kernels.py run their own cases
on the device too: scripts/gpu/tests.txt.)"""
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from test_kernels import CASE_IDS, CASES, MAX_REL_ERR, KV_HEADS, decode_inputs, rel_err  # noqa: E402
from test_sliding_window_kernels import TRITON_WINDOW_SOFTCAP  # noqa: E402

ATTENTION = [(None, None)] + TRITON_WINDOW_SOFTCAP
ATTENTION_IDS = [f"window{w}-softcap{c}" for w, c in ATTENTION]
LENS = [1, 45, 777, 1000, 4100]   # ragged, several splits' worth, past 64 tiles of 64


@pytest.mark.parametrize("window,softcap", ATTENTION, ids=ATTENTION_IDS)
@pytest.mark.parametrize("block_size,head_dim,gqa,kv_name", CASES, ids=CASE_IDS)
def test_decode_on_cuda(block_size, head_dim, gqa, kv_name, window, softcap):
    from batchrun.kernels import paged_attention, reference
    query, k, v, k_scale, v_scale, tables, lens = decode_inputs(block_size, head_dim, gqa, kv_name, LENS, seed=4)
    scale = head_dim ** -0.5
    ref = reference.paged_decode_attention(query.float(), k, v, tables, lens, scale, k_scale, v_scale,
                                           window=window, softcap=softcap)
    chosen = paged_attention.choose_num_splits(len(LENS), KV_HEADS, max(LENS), paged_attention._num_sms(query.device))
    assert chosen > 1, "the device's split count: these contexts must be split"
    for num_splits in (None, 1):
        out = torch.full_like(query, float("nan"))
        paged_attention.paged_decode_attention(query, k, v, tables, lens, scale, k_scale, v_scale,
                                               max_len=max(LENS), num_splits=num_splits, out=out, window=window,
                                               softcap=softcap)
        assert not out.isnan().any(), f"unwritten or NaN output with {num_splits} splits"
        assert rel_err(out, ref) < MAX_REL_ERR, f"{num_splits or chosen} splits"


@pytest.mark.parametrize("window,softcap", ATTENTION, ids=ATTENTION_IDS)
@pytest.mark.parametrize("block_size,head_dim,gqa,kv_name", CASES, ids=CASE_IDS)
def test_prefill_on_cuda(block_size, head_dim, gqa, kv_name, window, softcap):
    from batchrun.kernels import paged_attention, reference
    # (chunk, context): a whole prompt over several query tiles, a long chunk after a cached prefix, a decode row,
    # a short chunk at a block edge
    chunks = [(300, 300), (1000, 4100), (1, 777), (block_size, 2 * block_size)]
    query_lens, lens = [c[0] for c in chunks], [c[1] for c in chunks]
    _, k, v, k_scale, v_scale, tables, context_lens = decode_inputs(block_size, head_dim, gqa, kv_name, lens, seed=5)
    g = torch.Generator().manual_seed(6)
    query = torch.randn(sum(query_lens), KV_HEADS * gqa, head_dim, generator=g).to(torch.float16).cuda()
    starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).cuda()
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    paged_attention.paged_prefill_attention(query, k, v, tables, starts, context_lens.to(torch.int32), scale,
                                            k_scale, v_scale, out=out, window=window, softcap=softcap)
    ref = torch.cat([reference.paged_prefill_attention(query[starts[r]:starts[r + 1]].float(), k, v, tables[r],
                                                       lens[r], scale, k_scale, v_scale, window=window,
                                                       softcap=softcap) for r in range(len(chunks))])
    assert not out.isnan().any()
    assert rel_err(out, ref) < MAX_REL_ERR
