"""The CPU prefill of a chunk over its cached prefix (reference.paged_prefill_attention) against explicit causal
softmax attention in float64, on each of its paths: no prefix, a short prefix (plain causal attention over
zero queries for the prefix positions, rows dropped) and a long one (a mask)."""
import pytest
import torch

from batchrun.kernels import reference


@pytest.mark.parametrize("new,prefix", [(300, 0), (300, 40), (300, 200), (20, 10)])
def test_prefill_after_prefix_matches_explicit_attention(new, prefix):
    block_size, kv_heads, group, dim = 16, 3, 3, 32
    total = new + prefix
    blocks = -(-total // block_size)
    gen = torch.Generator().manual_seed(new + prefix)
    k = torch.randn(blocks + 2, block_size, kv_heads, dim, generator=gen)
    v = torch.randn(blocks + 2, block_size, kv_heads, dim, generator=gen)
    table = torch.randperm(blocks + 2, generator=gen)[:blocks]
    query = torch.randn(new, kv_heads * group, dim, generator=gen)
    got = reference.paged_prefill_attention(query, k, v, table, total, dim ** -0.5)

    keys = k[table].reshape(-1, kv_heads, dim)[:total].double().repeat_interleave(group, dim=1)
    values = v[table].reshape(-1, kv_heads, dim)[:total].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", query.double(), keys) * dim ** -0.5
    visible = torch.arange(total)[None, :] <= torch.arange(prefix, total)[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    want = torch.einsum("hnl,lhd->nhd", weights, values)
    assert got.shape == query.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
