"""Sliding window (query at position i sees keys j with i - W < j <= i) and attention logit soft-capping in every
attention path: the pure-torch reference against a dense brute force, the compiled CPU decode kernel and the
Triton kernels (under TRITON_INTERPRET=1 on CPU, small sizes) against the reference."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from batchrun.kernels import cpu_attention, reference  # noqa: E402

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # the Triton kernels' (the interpreter's on CPU)
# (window, soft-cap) of the Triton kernels' tests; tests/test_cuda_kernels.py crosses them with the KV dtypes
TRITON_WINDOW_SOFTCAP = [(5, None), (16, 2.0), (None, 2.0)]


def paged(lens, seed=0):
    """Random K/V for requests of `lens` tokens in a shuffled paged pool: (k, v, dense per request, tables)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(need) + 2
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=g)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used:used + n]
        used += n
    dense = [(k[tables[i]].reshape(-1, KV_HEADS, DIM)[:n], v[tables[i]].reshape(-1, KV_HEADS, DIM)[:n])
             for i, n in enumerate(lens)]
    return k, v, dense, tables


def brute_force(q, keys, values, q_pos, scale, window, softcap):
    """q [n, H, d] at positions q_pos; keys/values [L, Hkv, d]: a loop over query rows with explicit masks."""
    keys, values = keys.repeat_interleave(HEADS // KV_HEADS, 1), values.repeat_interleave(HEADS // KV_HEADS, 1)
    out = torch.empty_like(q)
    for r, i in enumerate(q_pos.tolist()):
        lo = 0 if window is None else max(0, i - window + 1)
        s = torch.einsum("hd,jhd->hj", q[r], keys[lo:i + 1]) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        out[r] = torch.einsum("hj,jhd->hd", torch.softmax(s, -1), values[lo:i + 1])
    return out


@pytest.mark.parametrize("window,softcap", [(5, None), (8, 2.0), (1, None), (None, 2.0)])
def test_reference_matches_brute_force(window, softcap):
    lens = [3, 13, 21]
    k, v, dense, tables = paged(lens)
    q = torch.randn(len(lens), HEADS, DIM)
    got = reference.paged_decode_attention(q, k, v, tables, torch.tensor(lens), 0.3, window=window, softcap=softcap)
    for b, n in enumerate(lens):
        want = brute_force(q[b:b + 1], *dense[b], torch.tensor([n - 1]), 0.3, window, softcap)
        torch.testing.assert_close(got[b:b + 1], want)
    # a chunk of 7 queries after a cached prefix of 14, and a whole prompt attending to itself
    n = lens[2]
    q = torch.randn(7, HEADS, DIM)
    got = reference.paged_prefill_attention(q, k, v, tables[2], n, 0.3, window=window, softcap=softcap)
    torch.testing.assert_close(got, brute_force(q, *dense[2], torch.arange(n - 7, n), 0.3, window, softcap))
    q = torch.randn(n, HEADS, DIM)
    got = reference.causal_attention(q, *dense[2], 0.3, window=window, softcap=softcap)
    torch.testing.assert_close(got, brute_force(q, *dense[2], torch.arange(n), 0.3, window, softcap))


@pytest.mark.parametrize("window,softcap", [(5, None), (7, 2.0), (None, 2.0)])
def test_cpu_kernel_window_and_softcap(window, softcap):
    if cpu_attention.load() is None:
        pytest.skip("no C++ toolchain: the engine uses the torch path (tested above)")
    lens = [1, 4, 6, 13, 21]   # windows starting mid-block, at a block edge, before the first token
    k, v, _, tables = paged(lens, seed=1)
    q = torch.randn(len(lens), HEADS, DIM)
    args = (q, k, v, tables, torch.tensor(lens), 0.3)
    torch.testing.assert_close(cpu_attention.paged_decode_attention(*args, window=window, softcap=softcap),
                               reference.paged_decode_attention(*args, window=window, softcap=softcap),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", TRITON_WINDOW_SOFTCAP)
def test_triton_kernels_window_and_softcap(window, softcap):
    pytest.importorskip("triton")
    from batchrun.kernels import paged_attention
    lens = [3, 13, 21, 40]
    k, v, _, tables = paged(lens, seed=2)
    context_lens = torch.tensor(lens)
    q = torch.randn(len(lens), HEADS, DIM)
    want = reference.paged_decode_attention(q, k, v, tables, context_lens, 0.3, window=window, softcap=softcap)
    on = [t.to(DEVICE) for t in (k, v, tables, context_lens)]
    for splits in (1, 2):   # with 2 splits, the first is wholly outside the window for the longer requests
        got = paged_attention.paged_decode_attention(q.to(DEVICE), *on, 0.3, num_splits=splits,
                                                     window=window, softcap=softcap, block_n=16)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    # prefill: chunks (query rows, context) of a whole prompt, one after a cached prefix, one decode row
    chunks = [(13, 13), (9, 21), (1, 40)]
    rows = sum(c[0] for c in chunks)
    q = torch.randn(rows, HEADS, DIM)
    starts = torch.tensor([0] + [c[0] for c in chunks]).cumsum(0).to(torch.int32)
    prefill_tables = tables[1:]
    got = paged_attention.paged_prefill_attention(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), prefill_tables.to(DEVICE), starts.to(DEVICE),
        torch.tensor([c[1] for c in chunks], dtype=torch.int32, device=DEVICE), 0.3, window=window, softcap=softcap,
        block_m=16, block_n=16).cpu()
    want = torch.cat([reference.paged_prefill_attention(q[starts[r]:starts[r + 1]], k, v, prefill_tables[r], ctx,
                                                        0.3, window=window, softcap=softcap)
                      for r, (_, ctx) in enumerate(chunks)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
