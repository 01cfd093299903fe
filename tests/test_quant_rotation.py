"""The Hadamard rotation of quantized layers' inputs (batchrun/quant/rotation.py) and the CPU kernel that rotates
and quantizes W8A8 activations in one pass and scales the product's rows (batchrun/kernels/rotate_quant.cpp)."""
import pytest
import torch

from batchrun.quant import quantize, rotation
from batchrun.quant.linear import QuantizedLinear, make_kernel
from quantkit import block_hadamard, sylvester


def test_the_hadamard_rotation_is_block_diagonal_and_its_own_inverse():
    assert [rotation.block_size(k) for k in (576, 1024, 1536, 96, 64)] == [64, 128, 128, 32, 64]
    torch.testing.assert_close(rotation.hadamard(64), sylvester(64))
    torch.testing.assert_close(rotation.hadamard(128) @ rotation.hadamard(128), torch.eye(128))
    x = torch.randn(3, 576).to(torch.bfloat16)
    rotated = rotation.rotate(x, rotation.hadamard(64), 64)
    assert rotated.dtype == torch.float32
    torch.testing.assert_close(rotated, x.float() @ torch.block_diag(*[sylvester(64)] * 9))
    with pytest.raises(ValueError, match="not a power of two"):
        rotation.hadamard(96)


@pytest.mark.parametrize("quantizer", ["int8", "fp8", "int4"])
def test_a_rotated_weight_dequantizes_to_the_weight(quantizer):
    torch.manual_seed(0)
    w = torch.randn(64, 256) / 16
    make = {"int8": quantize.int8_per_channel, "fp8": quantize.fp8_per_channel,
            "int4": lambda w, rotate_input: quantize.int4_grouped(w, rotate_input=rotate_input)}[quantizer]
    plain, rotated = make(w, rotate_input=False), make(w, rotate_input=True)
    assert plain.rotation is None and rotated.rotation == 128
    # data holds W H: its dequantized product with H is the weight
    h = block_hadamard(256)
    torch.testing.assert_close(rotated.dequantize(), make(w @ h, rotate_input=False).dequantize() @ h)
    err = (rotated.dequantize() - w).norm() / w.norm()
    assert err < {"int8": 0.01, "fp8": 0.05, "int4": 0.12}[quantizer]


def test_the_rotation_spreads_an_outlier_channel_for_w8a8():
    """Activations with an outlier channel (as SmolLM2's have): per-token int8 keeps a few levels for the other
    channels, unless the input is rotated first."""
    torch.manual_seed(0)
    x, w = torch.randn(32, 256), torch.randn(128, 256) / 16
    x[:, 7] *= 80
    exact = x @ w.t()

    def error(rotate_input: bool, fused: bool = True) -> float:
        q = quantize.int8_per_channel(w, "int8", rotate_input)
        owner = torch.nn.Linear(1, 1)   # the layer's weights are registered for as long as it lives
        layer = QuantizedLinear(owner, make_kernel([q]), 128, "int8", q.nbytes, q.rotation)
        layer.fused_rotation &= fused   # False: the dense rotation and fake_quantize_rows (no C++ kernel)
        layer.native &= fused
        return float((layer(x, None) - exact).norm() / exact.norm())
    plain, rotated, dense = error(False), error(True), error(True, fused=False)
    assert rotated < plain / 3, (plain, rotated)
    assert dense == pytest.approx(rotated, rel=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_rotation_kernel_quantizes_as_the_dense_rotation(dtype):
    """rotate_quant.cpp (a fast Walsh-Hadamard transform and the per-row int8 in one pass) against the dense
    rotation and fake_quantize_rows: the same scales, codes within one step (float sums in another order); the
    unsigned form is the same codes + 128. Blocks of 1 to 8 vectors go through registers where the CPU has
    AVX-512, a block of 8 channels through memory."""
    from batchrun.kernels import rotate_quant
    if rotate_quant.load() is None:
        pytest.skip("the C++ kernels do not build here")
    torch.manual_seed(0)
    for k, block in ((1024, 128), (576, 64), (96, 32), (48, 16), (24, 8)):
        x = torch.randn(5, k)
        x[:, 3] *= 50
        x = x.to(dtype)
        q, scale = rotate_quant.quantize(x, block)
        ref_q, ref_scale = quantize.fake_quantize_rows(x.float() @ block_hadamard(k), "int8")
        assert q.dtype == torch.int8 and scale.shape == (5, 1)
        torch.testing.assert_close(scale, ref_scale, rtol=1e-5, atol=0)
        assert (q.int() - ref_q.int()).abs().max() <= 1 and (q != ref_q).float().mean() < 0.01
        unsigned, unsigned_scale = rotate_quant.quantize(x, block, flip_sign=True)
        assert unsigned.dtype == torch.uint8 and torch.equal(unsigned_scale, scale)
        assert torch.equal(unsigned.int() - 128, q.int())
    with pytest.raises(RuntimeError, match="power of two dividing K"):
        rotate_quant.quantize(torch.randn(2, 96), 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_rows_multiplies_each_row_in_place_rounding_once(dtype):
    """The W8A8 product's row scale (rotate_quant.cpp): out[r] * scale[r] in float32, rounded once to out's dtype,
    whole vectors and tails alike."""
    from batchrun.kernels import rotate_quant
    if rotate_quant.load() is None:
        pytest.skip("the C++ kernels do not build here")
    torch.manual_seed(0)
    for n in (1, 7, 16, 31, 33, 100):
        out, scale = torch.randn(5, n).to(dtype), torch.rand(5, 1) * 3
        expected = (out.float() * scale).to(dtype)
        assert rotate_quant.scale_rows_(out, scale) is out
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="scale must be float32"):
        rotate_quant.scale_rows_(torch.randn(2, 4), torch.ones(3, 1))
