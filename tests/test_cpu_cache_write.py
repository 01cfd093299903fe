"""The CPU kernel's K/V cache write against the torch path (reference.write_kv_cache) for caches that store rows as
computed: the same pool, bit for bit."""
import pytest
import torch

from batchrun.kernels import cpu_attention, reference


@pytest.fixture(scope="module")
def kernel():
    if cpu_attention.load() is None:
        pytest.skip("no C++ toolchain: the engine writes with the torch path (tested elsewhere)")


def pools(dtype, blocks=6, block_size=4, kv_heads=3, head_dim=8):
    return [torch.randn(blocks, block_size, kv_heads, head_dim).to(dtype) for _ in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_write_matches_torch_path(kernel, dtype, tokens):
    blocks = (tokens + 3) // 4 + 2
    k, v = pools(dtype, blocks)
    k_ref, v_ref = k.clone(), v.clone()
    # key and value as the split of a fused QKV product gives them: each token's heads contiguous, tokens strided
    qkv = torch.randn(tokens, 5 * 3 * 8).to(dtype)
    key, value = qkv[:, 3 * 3 * 8:4 * 3 * 8].view(tokens, 3, 8), qkv[:, 4 * 3 * 8:].view(tokens, 3, 8)
    slots = torch.randperm(blocks * 4)[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1   # a padding row: skipped
    cpu_attention.write_kv_cache(key, value, k, v, slots)
    reference.write_kv_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_rows_in_any_layout_are_written(kernel):
    k, v = pools(torch.float32)
    key = torch.randn(3, 8, 3).transpose(1, 2)   # heads not contiguous within a token: copied first
    value = torch.randn(3, 3, 8)
    slots = torch.tensor([0, 9, 23])
    cpu_attention.write_kv_cache(key, value, k, v, slots)
    flat_k, flat_v = k.view(-1, 3, 8), v.view(-1, 3, 8)
    assert torch.equal(flat_k[slots], key) and torch.equal(flat_v[slots], value)


@pytest.mark.parametrize("slot", [24, -2])
def test_a_slot_outside_the_pool_is_refused(kernel, slot):
    k, v = pools(torch.float32)
    before = k.clone()
    with pytest.raises(RuntimeError, match=f"slot_mapping\\[1\\] = {slot}: outside the pool's 24 slots"):
        cpu_attention.write_kv_cache(torch.ones(2, 3, 8), torch.ones(2, 3, 8), k, v, torch.tensor([0, slot]))
    assert torch.equal(k, before)   # checked before any row is written


def test_dtype_mismatch_is_refused(kernel):
    k, v = pools(torch.bfloat16)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_attention.write_kv_cache(torch.ones(1, 3, 8), torch.ones(1, 3, 8), k, v, torch.tensor([0]))
    assert not cpu_attention.stores_as_computed(torch.ones(1), k, None)
    assert not cpu_attention.stores_as_computed(torch.ones(1, dtype=torch.bfloat16), k, torch.ones(1))
    assert cpu_attention.stores_as_computed(torch.ones(1, dtype=torch.bfloat16), k, None)
