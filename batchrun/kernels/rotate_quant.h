// The W8A8 activations of a layer quantized under the Hadamard rotation (batchrun/quant/rotation.py), in one pass
// over each row: x H (H block-diagonal, normalised Sylvester-Hadamard blocks of `block` channels) by a fast
// Walsh-Hadamard transform (log2(block) butterfly stages, K log2(block) additions a row, where the dense product
// took K x block multiply-adds), then symmetric per-row int8 as fake_quantize_rows does it: scale = max|x H| / 127
// (at least 1e-12 / 127), q = round-half-even((x H) / scale) clamped to +-127. The codes come out signed, or with
// the sign bit flipped (q + 128 as uint8) for kernels that take unsigned activations with zero point 128 (oneDNN's,
// cpu_kernels.Int8OneDNN): flipped here, a separate pass over the codes cost 2 % of an int8 decode step. Included by
// native_linear.cpp, which binds them and runs them inside its rotated W8A8 op.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "cpu_vec.h"

namespace batchrun {


// One block of b floats in place: the butterflies (a, c) -> (a + c, a - c) at distance h = 1, 2, .., b / 2.
inline void walsh_hadamard(float* y, int64_t b) {
  int64_t h = 1;
  for (; h < b && h < kLanes; h *= 2) {
    for (int64_t i = 0; i < b; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const float a = y[j], c = y[j + h];
        y[j] = a + c;
        y[j + h] = a - c;
      }
    }
  }
  for (; h < b; h *= 2) {
    for (int64_t i = 0; i < b; i += 2 * h) {
      for (int64_t j = i; j < i + h; j += kLanes) {
        const Vec a = Vec::loadu(y + j), c = Vec::loadu(y + j + h);
        (a + c).store(y + j);
        (a - c).store(y + j + h);
      }
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The butterflies at distance 1 << S inside one vector: lane j takes y[j] + y[j ^ h] where j & h is 0, else
// y[j ^ h] - y[j]. (A scalar loop at h = 1 cost 2.5x the rest of the kernel.)
template <int S>
inline __m512 butterfly(__m512 x) {
  constexpr int h = 1 << S;
  constexpr __mmask16 upper = S == 0 ? 0xAAAA : S == 1 ? 0xCCCC : S == 2 ? 0xF0F0 : 0xFF00;
  const __m512i partner = _mm512_xor_si512(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(h));
  const __m512 p = _mm512_permutexvar_ps(partner, x);
  return _mm512_mask_sub_ps(_mm512_add_ps(x, p), upper, p, x);
}

// One block of NV vectors, read from x (as float), transformed and scaled by `norm` in registers (each stage
// across all NV vectors, so their dependency chains overlap), written to y; returns the running max |y| lane-wise.
template <int NV, typename T>
inline Vec rotate_block(const T* x, float* y, float norm, Vec top) {
  __m512 v[NV];
  for (int j = 0; j < NV; ++j) v[j] = batchrun::load_float(x + j * kLanes);
  for (int j = 0; j < NV; ++j) v[j] = butterfly<0>(v[j]);
  for (int j = 0; j < NV; ++j) v[j] = butterfly<1>(v[j]);
  for (int j = 0; j < NV; ++j) v[j] = butterfly<2>(v[j]);
  for (int j = 0; j < NV; ++j) v[j] = butterfly<3>(v[j]);
  for (int h = 1; h < NV; h *= 2) {
    for (int i = 0; i < NV; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const __m512 a = v[j], c = v[j + h];
        v[j] = _mm512_add_ps(a, c);
        v[j + h] = _mm512_sub_ps(a, c);
      }
    }
  }
  for (int j = 0; j < NV; ++j) {
    const Vec out = Vec(v[j]) * Vec(norm);
    out.store(y + j * kLanes);
    top = at::vec::maximum(top, out.abs());
  }
  return top;
}

// x H of one row into y, scaled by norm, and its max |y| in amax; false (y and amax untouched) where the block
// size has no register path here.
template <typename T>
inline bool rotate_row_in_registers(const T* x, float* y, int64_t k, int64_t block, float norm, float& amax) {
  Vec top(0.f);
  for (int64_t b0 = 0; b0 < k; b0 += block) {
    switch (block / kLanes) {
      case 1: top = rotate_block<1>(x + b0, y + b0, norm, top); break;
      case 2: top = rotate_block<2>(x + b0, y + b0, norm, top); break;
      case 4: top = rotate_block<4>(x + b0, y + b0, norm, top); break;
      case 8: top = rotate_block<8>(x + b0, y + b0, norm, top); break;
      default: return false;
    }
  }
  amax = _mm512_reduce_max_ps(top);
  return true;
}
#else
template <typename T>
inline bool rotate_row_in_registers(const T*, float*, int64_t, int64_t, float, float&) { return false; }
#endif

// x H of one row into y, scaled by norm, through memory (any block size; the only path without AVX-512).
template <typename T>
float rotate_row(const T* x, float* y, int64_t k, int64_t block, float norm) {
  batchrun::row_to_float(x, y, k);
  for (int64_t b0 = 0; b0 < k; b0 += block) walsh_hadamard(y + b0, block);
  float amax = 0.f;
  for (int64_t c = 0; c < k; ++c) {
    y[c] *= norm;
    amax = std::max(amax, std::fabs(y[c]));
  }
  return amax;
}

template <typename T>
void rotate_rows(const T* x, uint8_t* q, float* scale, int64_t rows, int64_t k, int64_t block, bool flip_sign) {
  const float norm = 1.f / std::sqrt(static_cast<float>(block));
  const uint8_t flip = flip_sign ? 0x80 : 0;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> y(batchrun::padded(k));
    for (int64_t r = begin; r < end; ++r) {
      float amax;
      if (!rotate_row_in_registers(x + r * k, y.data(), k, block, norm, amax)) {
        amax = rotate_row(x + r * k, y.data(), k, block, norm);
      }
      const float s = std::max(amax, 1e-12f) / 127.f;
      scale[r] = s;
      uint8_t* out = q + r * k;
      int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512)
      const Vec sv(s), low(-127.f), high(127.f);
      const __m128i flip_bits = _mm_set1_epi8(static_cast<char>(flip));
      for (; c + kLanes <= k; c += kLanes) {   // the conversion rounds half to even, as torch.round
        const __m512 v = at::vec::clamp(Vec::loadu(y.data() + c) / sv, low, high);
        const __m128i codes = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), _mm_xor_si128(codes, flip_bits));
      }
#endif
      for (; c < k; ++c) {
        const auto code = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(y[c] / s))));
        out[c] = static_cast<uint8_t>(code) ^ flip;
      }
    }
  });
}

// x [rows, K] -> (codes [rows, K]: int8, or uint8 = int8 + 128 where flip_sign; float32 scale [rows, 1]).
inline std::tuple<at::Tensor, at::Tensor> rotate_quantize(const at::Tensor& x, int64_t block, bool flip_sign) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rotate_quantize: x must be a contiguous [rows, K] tensor");
  TORCH_CHECK(block >= 1 && (block & (block - 1)) == 0 && x.size(1) % block == 0,
              "rotate_quantize: block ", block, " must be a power of two dividing K = ", x.size(1));
  const int64_t rows = x.size(0), k = x.size(1);
  auto q = at::empty({rows, k}, x.options().dtype(flip_sign ? at::kByte : at::kChar));
  auto scale = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  auto* codes = static_cast<uint8_t*>(q.data_ptr());
  if (x.scalar_type() == at::kFloat) {
    rotate_rows(x.data_ptr<float>(), codes, scale.data_ptr<float>(), rows, k, block, flip_sign);
  } else if (x.scalar_type() == at::kBFloat16) {
    rotate_rows(x.data_ptr<at::BFloat16>(), codes, scale.data_ptr<float>(), rows, k, block, flip_sign);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kHalf, "rotate_quantize: x must be float32, bfloat16 or float16");
    rotate_rows(x.data_ptr<at::Half>(), codes, scale.data_ptr<float>(), rows, k, block, flip_sign);
  }
  return {q, scale};
}

// out [rows, N] *= scale [rows, 1] in place, in float32 and rounded once to out's dtype: the W8A8 product's row
// scale. aten's mul_ of a bfloat16 tensor by a float32 one widens into a temporary and copies back, 6 % of an int8
// decode step on the 0.3B Llama shape.
template <typename T>
void scale_rows(T* out, const float* scale, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Vec s(scale[r]);
      T* row = out + r * n;
      int64_t c = 0;
      if constexpr (!std::is_same_v<T, float>) {   // whole 16-bit vectors (two float ones): no partial stores
        using Vec16 = at::vec::Vectorized<T>;
        for (; c + Vec16::size() <= n; c += Vec16::size()) {
          const auto [low, high] = at::vec::convert_to_float<T>(Vec16::loadu(row + c));
          at::vec::convert_from_float<T>(low * s, high * s).store(row + c);
        }
      }
      for (; c < n; c += kLanes) {
        const int64_t m = std::min(kLanes, n - c);
        batchrun::store_float(batchrun::load_float(row + c, m) * s, row + c, m);
      }
    }
  });
}

inline at::Tensor scale_rows_(at::Tensor out, const at::Tensor& scale) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "scale_rows_: out must be a contiguous [rows, N] tensor");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == out.size(0),
              "scale_rows_: scale must be float32 [rows, 1]");
  const int64_t rows = out.size(0), n = out.size(1);
  if (out.scalar_type() == at::kFloat) {
    scale_rows(out.data_ptr<float>(), scale.data_ptr<float>(), rows, n);
  } else if (out.scalar_type() == at::kBFloat16) {
    scale_rows(out.data_ptr<at::BFloat16>(), scale.data_ptr<float>(), rows, n);
  } else {
    TORCH_CHECK(out.scalar_type() == at::kHalf, "scale_rows_: out must be float32, bfloat16 or float16");
    scale_rows(out.data_ptr<at::Half>(), scale.data_ptr<float>(), rows, n);
  }
  return out;
}

}  // namespace batchrun
