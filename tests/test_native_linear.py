"""The C++ linear operators (batchrun/kernels/native_linear.cpp) give what the Python paths they replace give, bit
for bit, and refuse a handle they do not hold; a layer's weight leaves their registry with the layer."""
import gc

import pytest
import torch
import torch.nn.functional as F

from batchrun.kernels import native_linear
from batchrun.models import cpu_gemm, graph
from batchrun.models.layers import Linear
from batchrun.quant import cpu_kernels, quantize
from batchrun.quant.linear import QuantizedLinear, make_kernel

pytestmark = pytest.mark.skipif(native_linear.load() is None or not torch.backends.mkldnn.is_available(),
                                reason="the native linear module does not build here, or no oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_the_python_path(dtype, bias):
    torch.manual_seed(0)
    layer = Linear(96, 80, bias=bias).to(dtype)
    weight = layer.weight.detach().clone()
    if not layer.pack_for_cpu() or not isinstance(layer.packed, torch.Tensor):
        pytest.skip(f"{dtype} weights are not oneDNN-packed here")
    assert layer.native
    for rows in (1, 7, 33):
        x = torch.randn(rows, 96, dtype=dtype)
        out = layer(x)
        assert torch.equal(out, cpu_gemm.linear(x, layer.packed, layer.bias))
        torch.testing.assert_close(out, F.linear(x, weight, layer.bias), rtol=2e-2 if dtype != torch.float32 else 1e-5,
                                   atol=2e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotated_w8a8_equals_the_python_path(dtype):
    torch.manual_seed(0)
    weight = quantize.int8_per_channel(torch.randn(192, 256) / 16, "int8", rotate_input=True)
    kernel = make_kernel([weight])
    if not isinstance(kernel, cpu_kernels.Int8OneDNN):
        pytest.skip("W8A8 runs on another kernel here")
    owner = torch.nn.Linear(1, 1)
    layer = QuantizedLinear(owner, kernel, 192, "int8", weight.nbytes, weight.rotation)
    assert layer.native
    for rows in (1, 5, 32):
        x = torch.randn(rows, 256, dtype=dtype)
        out = layer(x, None)
        assert out.dtype == dtype and out.shape == (rows, 192)
        assert torch.equal(out, kernel.rotated_product(x, weight.rotation))


def test_a_handle_not_held_is_refused_by_name():
    module = native_linear.load()
    layer = Linear(16, 8)
    if not layer.pack_for_cpu() or not layer.native:
        pytest.skip("float32 weights are not oneDNN-packed here")
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="is not int8"):
        torch.ops.batchrun_native.rotated_w8a8(x, layer.handle, 8, 16)
    handle = layer.handle
    graph.release(handle)
    with pytest.raises(RuntimeError, match=f"no weight is registered under handle {handle}"):
        torch.ops.batchrun_native.packed_linear(x, handle, 8, None)
    module.register_weight(handle, layer.packed, None, None)
    del layer
    gc.collect()   # the layer's finalizer drops its handle, even re-registered
    with pytest.raises(RuntimeError, match="no weight is registered"):
        torch.ops.batchrun_native.packed_linear(x, handle, 8, None)
