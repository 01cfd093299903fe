"""Triton dequant-GEMM kernels against the product with the dequantized weight; on CPU under TRITON_INTERPRET=1
(set in conftest.py). Sizes cross the tile edges: rows 1 (decode of one request), 17 and 70 (past the 16/32/64-row
tiles), output channels not a multiple of the 64-column tile, input features past one 64-wide K tile."""
import pytest
import torch

pytest.importorskip("triton")

from batchrun.kernels import quant_gemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [1, 17, 70]
# Triton's interpreter (3.9) computes tl.dot on bfloat16 operands wrongly (off by 1e10 on a 16x16 product),
# so bfloat16 runs only on a GPU.
BF16 = pytest.param(torch.bfloat16, 1e-2, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="the Triton interpreter's tl.dot is wrong for bfloat16"))


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_int8(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.02 + 1e-3
    return w, scale


def random_int4(n, k, group, seed):
    """(packed [n, k/2] uint8, codes [n, k], scales, zeros [n, k/group])."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.rand(n, k // group, generator=g) * 0.05 + 1e-3
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float()
    return packed, codes, scales, zeros


def dequant_int4(codes, scales, zeros, group):
    return (codes.float() - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), BF16])
@pytest.mark.parametrize("rows", ROWS)
def test_int8_linear_matches_dequantized_product(rows, dtype, tol):
    w, scale = random_int8(80, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(80).to(dtype)
    ref = x.float() @ (w.float() * scale[:, None]).T + bias.float()
    out = quant_gemm.int8_linear(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE))
    assert out.dtype == dtype and out.shape == (rows, 80)
    assert rel_err(out.cpu(), ref) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), BF16])
@pytest.mark.parametrize("rows,group", [(1, 32), (17, 128), (70, 64)])
def test_int4_linear_matches_dequantized_product(rows, group, dtype, tol):
    packed, codes, scales, zeros = random_int4(72, 256, group, seed=rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = x.float() @ dequant_int4(codes, scales, zeros, group).T
    out = quant_gemm.int4_linear(x.to(DEVICE), packed.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), group)
    assert out.dtype == dtype and out.shape == (rows, 72)
    assert rel_err(out.cpu(), ref) < tol


def test_int4_nibble_order_low_first():
    """One weight row with code 1 at even k and 2 at odd k: low nibble is the even input feature."""
    packed = torch.full((1, 32), 1 | (2 << 4), dtype=torch.uint8)
    x = torch.zeros(1, 64)
    x[0, 0] = 1.0                       # picks k = 0 (even): code 1
    x[0, 1] = 10.0                      # picks k = 1 (odd): code 2
    ones, zeros = torch.ones(1, 1), torch.zeros(1, 1)
    out = quant_gemm.int4_linear(x.to(DEVICE), packed.to(DEVICE), ones.to(DEVICE), zeros.to(DEVICE), 64)
    assert out.item() == 1.0 * 1 + 10.0 * 2


def test_empty_batch_and_shape_errors():
    w, scale = random_int8(8, 64, seed=0)
    assert quant_gemm.int8_linear(torch.empty(0, 64), w, scale).shape == (0, 8)
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\]"):
        quant_gemm.int8_linear(torch.randn(2, 32), w, scale)
    with pytest.raises(ValueError, match="scale must be"):
        quant_gemm.int8_linear(torch.randn(2, 64), w, scale[:4])
    packed, _, scales, zeros = random_int4(8, 64, 32, seed=0)
    with pytest.raises(ValueError, match="does not divide"):
        quant_gemm.int4_linear(torch.randn(2, 64), packed, scales, zeros, 48)
    with pytest.raises(ValueError, match=r"zeros must be \[8, 2\]"):
        quant_gemm.int4_linear(torch.randn(2, 64), packed, scales, zeros[:, :1], 32)
