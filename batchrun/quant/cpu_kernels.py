"""CPU matrix products for quantized weights, each built once at load from the canonical QuantizedWeight (the CPU
packing happens here, and only on the CPU). A kernel is called with x [M, K] (bfloat16 or float32) and returns
x @ w^T [M, N] in x's dtype, without bias.

Measured with bench/quant_kernels.py (Intel Xeon with AVX-512 BF16/VNNI and AMX; 2 threads on a machine shared
with other work, load average 1.6-2: ratios within one run; one decoder layer's four products, bfloat16
activations; ms, lower is better):

                              bf16 packed  fp32 packed  w8a16  w8a8-onednn  w8a8-intmm  fp8-scaledmm  fp8-dequant  int4
    SmolLM2, 32 rows (decode)     8.5          7.4      13.9       3.9         0.9         81.0          91.7       5.4
    SmolLM2, 1,024 rows          13.4         63.9     126.0     215.2       213.9        229.4         157.2     131.8
    0.3B Llama, 32 rows          25.4         35.5      40.6       8.8        17.2        348.2         211.7      30.3
    0.3B Llama, 1,024 rows      118.5        602.2    1241.1     398.3       739.1       1690.6        1101.4    1129.5

So linear.py picks: W8A8 -> batchrun's AMX kernel where the CPU has AMX (Int8Amx, measured later: one thread,
the 0.3B shapes at 32 rows 1.39 ms a layer against qlinear's 1.83; equal at 256 rows), else oneDNN qlinear
(2.2-2.9x the bf16 path at decode; 0.3x at a 1,024-row prefill
chunk in that run, where the float32 result was scaled out of place: with the result in the activations' dtype
scaled in place, one 0.3B gate/up product at 1,024 rows takes 16 ms (plus 4.7 ms to quantize the activations
eagerly) against packed bf16's 22, one thread; _int_mm was faster on SmolLM2's small decode products in this single noisy run but 2x
slower than oneDNN on the 0.3B shapes, not re-measured), its activations unsigned, where it runs a fast path
(onednn_int8_runs_fast; on an AMD EPYC without AMX, one thread, 32 rows: 0.70 / 0.66 ms for the 0.3B's
1,024 -> 4,096 / 4,096 -> 1,024 against packed bf16's 1.62 / 1.28 and _int_mm's 1.09 / 2.00), else _int_mm;
W8A16 -> _weight_int8pack_mm (the only int8-weight, 16-bit-activation kernel shipped; slower than bf16) at decode
sizes below DEQUANT_ROWS, else its weight widened and a dense product (Int8WeightOnly), fp8 ->
the widening emulation (torch._scaled_mm on the CPU is slower still at decode), int4 -> the int4pack kernel (1.6x
bf16 on SmolLM2's decode, 0.84x on the 0.3B shape; at float32 compute the nibbles widened for a dense product,
Int4Widened). No shipped kernel beats packed bf16 at prefill sizes.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from batchrun.cpu_timing import one_thread, seconds
from batchrun.kernels import amx_linear, rotate_quant
from batchrun.quant import quantize
from batchrun.quant.quantize import fake_quantize_rows
from batchrun.quant.weights import QuantizedWeight, unpack_int4

BATCH_HINT = 32   # the row count qlinear_prepack tunes for (decode steps)
INT4_INNER_K_TILES = 8
DEQUANT_ROWS = 128   # W8A16 products of at least this many 16-bit rows widen the weight for a dense product
WIDEN_BYTES = 64 << 20   # the most a widened weight's temporary holds: larger layers are widened in row chunks


def _by_dtype(t: torch.Tensor) -> dict[torch.dtype, torch.Tensor]:
    return {dtype: t.to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}


def _widened_product(x: torch.Tensor, out_features: int, widen) -> torch.Tensor:
    """x @ W^T with W widened to x's dtype by widen(lo, hi) (its output rows lo..hi), a chunk of rows at a time so
    that the temporary stays within WIDEN_BYTES (a 70B model's MLP projection is about 1 GB at float32)."""
    chunk = max(1, WIDEN_BYTES // (x.shape[1] * x.element_size()))
    if chunk >= out_features:
        return F.linear(x, widen(0, out_features))
    out = x.new_empty(x.shape[0], out_features)
    for lo in range(0, out_features, chunk):
        hi = min(out_features, lo + chunk)
        out[:, lo:hi] = F.linear(x, widen(lo, hi))
    return out


def _gather(x: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    return x if perm is None else x.index_select(1, perm)


class Int8WeightOnly:
    """W8A16: the weight widened to the activations' dtype (one pass into a temporary of at most WIDEN_BYTES) and a
    dense product, for float32 rows and from DEQUANT_ROWS 16-bit rows on; below that aten._weight_int8pack_mm (the
    scales must be in the activations' dtype). Sixteen distinct 0.3B Llama layers' four products each (weights from
    memory), bfloat16, two threads, AMD EPYC with avx512_bf16: 128 rows 510-523 ms by int8pack against 237-240 widened,
    256 rows 991-1,056 against 421-426; at 32 rows 137-236 against 113-120, but the engine's decode (32 rows) ran at
    0.50x bf16 either way in one run, so decode keeps int8pack. float32, where aten's int8pack is not vectorised (one
    layer's four products): 32 rows 563 ms against 27 widened (12.8 for float32 weights), 512 rows 4.1 s against
    0.11."""

    def __init__(self, w: QuantizedWeight):
        self.data, self.scales = w.data.contiguous(), _by_dtype(w.scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 or x.shape[0] >= DEQUANT_ROWS:
            scale = self.scales[x.dtype][:, None]
            return _widened_product(x, self.data.shape[0],
                                    lambda lo, hi: self.data[lo:hi].to(x.dtype).mul_(scale[lo:hi]))
        return torch.ops.aten._weight_int8pack_mm(x, self.data, self.scales[x.dtype])


class W8A8:
    """A W8A8 kernel: the activations quantized per token (or by the static scale), then the subclass's
    `codes_product` (without the row scale), then the row scale. linear.py quantizes the activations itself (traced) and
    calls `product` or `scaled_product`, or, for a layer under the rotation, calls `rotated_product`."""
    input_scale: torch.Tensor | None
    unsigned_codes = False   # whether the kernel's own form of the codes is uint8 (int8 + 128), see codes_product

    def product(self, qx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The product of int8 activations, without their row scale."""
        return self.codes_product(qx, dtype)

    def codes_product(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The product of activation codes in the kernel's own form (int8, or uint8 where unsigned_codes)."""
        raise NotImplementedError

    def scaled_product(self, qx: torch.Tensor, row_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # In place in the activations' dtype: a float32 result scaled out of place cost 4x the product itself at
        # 1,024 rows (a fresh 32 MiB result and a broadcast over two copies); aten's mul_ by the float32 scale
        # still widens into a temporary, scale_rows_ does not.
        product = self.product(qx, dtype)
        if rotate_quant.load() is None:
            return product.mul_(row_scale).to(dtype)
        return rotate_quant.scale_rows_(product, row_scale.contiguous()).to(dtype)   # a static scale is expanded

    def rotated_product(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """x [M, K] rotated and quantized per row in one pass (rotate_quant.cpp, straight into the kernel's form of
        the codes), the product, the row scale: the layer's output in x's dtype."""
        codes, row_scale = rotate_quant.quantize(x, block, flip_sign=self.unsigned_codes)
        return rotate_quant.scale_rows_(self.codes_product(codes, x.dtype), row_scale).to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        qx, row_scale = fake_quantize_rows(x, "int8", self.input_scale)
        return self.scaled_product(qx, row_scale, x.dtype)


class Int8OneDNN(W8A8):
    """W8A8 through oneDNN's qlinear on a pre-packed weight, the weight scale applied inside.

    The activations go in unsigned, with zero point 128 (the sign bit flipped: v + 128 for every int8 v): oneDNN's
    fast int8 products multiply unsigned by signed bytes (VNNI's vpdpbusd), and given signed activations it fell
    back to its reference matmul (`ref_int8` in ONEDNN_VERBOSE) on an AMD EPYC with AVX512-VNNI: 640 ms for SmolLM2's
    576 -> 1,536 product at 32 rows, against 0.18 ms unsigned (packed bf16: 0.33). Exact either way."""
    unsigned_codes = True

    def __init__(self, w: QuantizedWeight):
        self.packed = torch.ops.onednn.qlinear_prepack(w.data.contiguous(), [BATCH_HINT, w.in_features])
        self.scale, self.input_scale = w.scale.float(), w.input_scale
        self.zero_points = torch.zeros(w.out_features, dtype=torch.long)

    def product(self, qx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.codes_product(qx.view(torch.uint8).bitwise_xor(0x80), dtype)

    def codes_product(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.ops.onednn.qlinear_pointwise(codes, 1.0, 128, self.packed, self.scale, self.zero_points, None,
                                                  1.0, 0, product_dtype(dtype), "none", [], "")


class Int8Amx(W8A8):
    """W8A8 on AMX tiles (kernels/amx_linear.py): the int8 weight packed once, streamed at a decode step's rows
    as the bfloat16 kernel streams its weights, the weight scale applied in the kernel."""

    def __init__(self, w: QuantizedWeight):
        self.packed = amx_linear.PackedWeight(w.data)
        self.scale, self.input_scale = w.scale.float().reshape(-1).contiguous(), w.input_scale

    def codes_product(self, qx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return amx_linear.int8_product(qx, self.packed, self.scale, product_dtype(dtype))


class Int8IntMM(W8A8):
    """W8A8 through aten._int_mm (int8 x int8 -> int32), both scales applied after."""

    def __init__(self, w: QuantizedWeight):
        self.weight_t = w.data.t()
        self.scale, self.input_scale = w.scale.float(), w.input_scale

    def codes_product(self, qx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (torch._int_mm(qx, self.weight_t) * self.scale).to(product_dtype(dtype))


@functools.cache
def onednn_int8_runs_fast() -> bool:
    """Whether oneDNN's qlinear runs a fast int8 path here: whether one of 3 runs of a small decode-sized product
    (32 rows, 256 -> 512, after a warm-up, on one thread) takes at most 30x aten._int_mm's best of 5. Where oneDNN
    has no fast int8 path for the CPU it runs its reference matmul, about 1,000x slower (AMD EPYC with AVX512-VNNI,
    one thread, best of 5: 89 ms by the reference path against 77 us fast and 42 us by _int_mm), so the margin is
    wide. One thread, because on a busy machine two threads wait for each other: with four busy processes on the two
    cores both products took 12 ms a run for 100 ms at a stretch (the median of either), and a 3x margin on two
    threads' best of 3 judged the fast path slow in CI and in 17 of 200 probes there. Only the reference path is
    caught: at the real layers' shapes the fast qlinear measured 1.0-3.0x faster than _int_mm (AMD EPYC, one thread,
    32 and 256 rows: SmolLM2's 576 -> 1,536, the 0.3B Llama's 1,024 -> 4,096 and 4,096 -> 1,024), a difference this
    small product does not show."""
    rng = torch.Generator().manual_seed(0)   # not the caller's random state
    weight = quantize.int8_per_channel(torch.randn(512, 256, generator=rng), "int8")
    qx = torch.randint(-127, 128, (BATCH_HINT, 256), dtype=torch.int8, generator=rng)
    onednn, int_mm = Int8OneDNN(weight), Int8IntMM(weight)
    with one_thread():
        int_mm.product(qx, torch.float32)
        limit = 30 * min(seconds(lambda: int_mm.product(qx, torch.float32)) for _ in range(5))
        onednn.product(qx, torch.float32)
        return any(seconds(lambda: onednn.product(qx, torch.float32)) <= limit for _ in range(3))


def product_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


class Fp8ScaledMM:
    """FP8 W8A8: e4m3 activations per token, torch._scaled_mm with row-wise scales."""

    def __init__(self, w: QuantizedWeight):
        self.weight_t, self.scale, self.input_scale = w.data.t(), w.scale.float()[None, :], w.input_scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        fx, row_scale = fake_quantize_rows(x, "fp8", self.input_scale)
        return torch._scaled_mm(fx, self.weight_t, scale_a=row_scale, scale_b=self.scale, out_dtype=x.dtype)


class Fp8Dequant:
    """FP8 emulated: the e4m3 weight (and activations, when W8A8) widened to the activations' dtype at each call
    (exactly: e4m3 values are representable in bf16; WIDEN_BYTES of weight at a time), a float product, the scales
    applied after."""

    def __init__(self, w: QuantizedWeight):
        self.data, self.scales = w.data, _by_dtype(w.scale)
        self.activations, self.input_scale = w.activations, w.input_scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "fp8":
            fx, row_scale = fake_quantize_rows(x, "fp8", self.input_scale)
            product = _widened_product(fx.to(x.dtype), self.data.shape[0], self._widen(x.dtype))
            return (product * row_scale * self.scales[torch.float32]).to(x.dtype)
        return _widened_product(x, self.data.shape[0], self._widen(x.dtype)) * self.scales[x.dtype]

    def _widen(self, dtype: torch.dtype):
        return lambda lo, hi: self.data[lo:hi].to(dtype)


class Int4Packed:
    """W4A16: aten._weight_int4pack_mm_for_cpu on a weight packed once by _convert_weight_to_int4pack_for_cpu.
    Its dequant is (q - 8) * scale + offset, so the canonical zero point becomes offset = (8 - zero) * scale."""

    def __init__(self, w: QuantizedWeight):
        self.group_size, self.perm = w.group_size, w.input_perm
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(w.data).to(torch.int32),
                                                                         INT4_INNER_K_TILES)
        scale_and_offset = torch.stack([w.scale.t(), ((8 - w.zeros) * w.scale).t()], dim=-1).contiguous()
        self.scale_and_offset = _by_dtype(scale_and_offset)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(_gather(x, self.perm), self.packed, self.group_size,
                                                          self.scale_and_offset[x.dtype])


class Int4Widened:
    """W4A16 at float32 compute: the nibbles widened to float32 for each call (one unpack, then scale and offset in one
    pass, WIDEN_BYTES at a time) and a dense product; exact against the dequantized weight. aten's int4pack runs float32
    rows on a path that is not vectorised: one 0.3B Llama layer's four products at 32 rows 1,006 ms against 56 widened
    (12.8 for float32 weights), at 512 rows 7.5 s against 0.14 (AMD EPYC, two threads). It holds the canonical nibbles
    only (no packed copy)."""

    def __init__(self, w: QuantizedWeight):
        self.data, self.perm, self.group_size = w.data.contiguous(), w.input_perm, w.group_size
        self.scale = w.scale.contiguous()[..., None]   # [N, K // G, 1]
        self.offset = (-w.zeros * w.scale).contiguous()[..., None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _widened_product(_gather(x, self.perm), self.data.shape[0],
                                lambda lo, hi: self._widen(lo, hi, x.dtype))

    def _widen(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_int4(self.data[lo:hi]).view(hi - lo, -1, self.group_size).to(dtype)
        return torch.addcmul(self.offset[lo:hi].to(dtype), codes, self.scale[lo:hi].to(dtype)).view(hi - lo, -1)


KERNELS = {"w8a16": Int8WeightOnly, "w8a8-amx": Int8Amx, "w8a8-onednn": Int8OneDNN, "w8a8-intmm": Int8IntMM,
           "fp8-scaledmm": Fp8ScaledMM, "fp8-dequant": Fp8Dequant, "int4": Int4Packed, "int4-widened": Int4Widened}
