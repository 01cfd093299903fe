"""The AMX bfloat16 linear kernel (kernels/amx_linear.cpp) against a float32 product, and where cpu_gemm uses it."""
import pytest
import torch
import torch.nn.functional as F

from batchrun.kernels import amx_linear
from batchrun.models import cpu_gemm

needs_amx = pytest.mark.skipif(not amx_linear.available(), reason="no AMX-BF16 tiles on this CPU (or no compiler)")


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).bfloat16(), torch.randn(n, generator=g).bfloat16()


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("n,k", [(32, 32), (40, 64), (960, 576), (7, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_product(rows, n, k, with_bias):
    w, b = _weights(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = b if with_bias else None
    got = amx_linear.linear(x, amx_linear.PackedWeight(w), bias)
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # float32 accumulation, one rounding to bfloat16 at the end: within a bfloat16 step of the float32 product
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item())


@needs_amx
def test_a_row_does_not_depend_on_the_others():
    """Deterministic mode relies on it: each row's sums run in the same order whatever rows share the call."""
    w, b = _weights(100, 96)
    x = torch.randn(45, 96).bfloat16()
    packed = amx_linear.PackedWeight(w)
    whole = amx_linear.linear(x, packed, b)
    for i in (0, 15, 16, 31, 32, 44):
        assert torch.equal(whole[i:i + 1], amx_linear.linear(x[i:i + 1], packed, b))


@needs_amx
def test_unpacks_to_the_weight():
    w, _ = _weights(40, 64)
    assert torch.equal(amx_linear.PackedWeight(w).to_dense(), w)


@needs_amx
def test_cpu_gemm_routes_bfloat16_to_the_kernel():
    w, b = _weights(64, 96)
    packed = cpu_gemm.pack(w)
    assert isinstance(packed, amx_linear.PackedWeight)
    x = torch.randn(8, 96).bfloat16()
    assert torch.equal(cpu_gemm.linear(x, packed, b), amx_linear.linear(x, packed, b))
    assert not isinstance(cpu_gemm.pack(w.float()), amx_linear.PackedWeight)         # float32: oneDNN
    assert not isinstance(cpu_gemm.pack(_weights(64, 48)[0]), amx_linear.PackedWeight)   # inputs not 32k: oneDNN


def test_without_amx_cpu_gemm_packs_for_onednn(monkeypatch):
    monkeypatch.setattr(amx_linear, "available", lambda: False)
    w, _ = _weights(64, 96)
    packed = cpu_gemm.pack(w)
    assert not isinstance(packed, amx_linear.PackedWeight)
    if packed is not None:   # oneDNN can pack bfloat16 on this CPU
        x = torch.randn(4, 96).bfloat16()
        torch.testing.assert_close(cpu_gemm.linear(x, packed, None).float(), F.linear(x.float(), w.float()),
                                   rtol=8e-3, atol=5e-3)


@needs_amx
@pytest.mark.parametrize("rows", [1, 16, 33, 70])
@pytest.mark.parametrize("n,k", [(32, 64), (40, 128), (960, 576), (7, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_product_is_exact(rows, n, k, dtype):
    """int32 sums (exact), then one float32 multiply by the column scale and one rounding to the output dtype."""
    g = torch.Generator().manual_seed(2)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    qx = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01
    got = amx_linear.int8_product(qx, amx_linear.PackedWeight(w), scale, dtype)
    sums = (qx.long() @ w.long().T).to(torch.int32)
    assert got.dtype == dtype and torch.equal(got, (sums.float() * scale).to(dtype))


@needs_amx
def test_int8_unpacks_to_the_weight():
    w = torch.randint(-127, 128, (40, 128), dtype=torch.int8)
    assert torch.equal(amx_linear.PackedWeight(w).to_dense(), w)
