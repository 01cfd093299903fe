// The W8A8 activations of a layer quantized under the Hadamard rotation (batchrun/quant/rotation.py), in one pass
// over each row: x H (H block-diagonal, normalised Sylvester-Hadamard blocks of `block` channels) by a fast
// Walsh-Hadamard transform (log2(block) butterfly stages, K log2(block) additions a row, where the dense product
// took K x block multiply-adds), then symmetric per-row int8 as fake_quantize_rows does it: scale = max|x H| / 127
// (at least 1e-12 / 127), q = round-half-even((x H) / scale) clamped to +-127. Built by rotate_quant.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "cpu_vec.h"

namespace {

using batchrun::kLanes;
using batchrun::Vec;

#if defined(CPU_CAPABILITY_AVX512)
// The butterflies at distance h inside one vector: lane j takes y[j] + y[j ^ h] where j & h is 0, else
// y[j ^ h] - y[j]. (A scalar loop at h = 1 cost 2.5x the rest of the kernel.)
inline Vec butterfly(const Vec& v, int h) {
  static const __m512i partner[4] = {
      _mm512_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14),
      _mm512_setr_epi32(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13),
      _mm512_setr_epi32(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11),
      _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)};
  static const __mmask16 upper[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
  const int stage = __builtin_ctz(h);
  const __m512 x = v, p = _mm512_permutexvar_ps(partner[stage], x);
  return _mm512_mask_sub_ps(_mm512_add_ps(x, p), upper[stage], p, x);
}
constexpr bool kInVector = true;
#else
inline Vec butterfly(const Vec& v, int) { return v; }
constexpr bool kInVector = false;
#endif

// One block of b floats in place: the butterflies (a, c) -> (a + c, a - c) at distance h = 1, 2, .., b / 2, those
// shorter than a vector inside each vector where the CPU has the permutes for it, the longer ones across vectors.
inline void walsh_hadamard(float* y, int64_t b) {
  int64_t h = 1;
  if (kInVector && b >= kLanes) {
    for (int64_t j = 0; j < b; j += kLanes) {
      Vec v = Vec::loadu(y + j);
      for (int s = 1; s < kLanes; s *= 2) v = butterfly(v, s);
      v.store(y + j);
    }
    h = kLanes;
  }
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

template <typename T>
void rotate_rows(const T* x, int8_t* q, float* scale, int64_t rows, int64_t k, int64_t block) {
  const float norm = 1.f / std::sqrt(static_cast<float>(block));
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> y(batchrun::padded(k));
    for (int64_t r = begin; r < end; ++r) {
      batchrun::row_to_float(x + r * k, y.data(), k);
      Vec top(0.f);
      for (int64_t b0 = 0; b0 < k; b0 += block) {
        walsh_hadamard(y.data() + b0, block);
      }
      int64_t c = 0;
      for (; c + kLanes <= k; c += kLanes) {
        const Vec v = Vec::loadu(y.data() + c) * Vec(norm);
        v.store(y.data() + c);
        top = at::vec::maximum(top, v.abs());
      }
      float amax = 0.f;
      float lanes[kLanes];
      top.store(lanes);
      for (int64_t i = 0; i < kLanes; ++i) amax = std::max(amax, lanes[i]);
      for (; c < k; ++c) {
        y[c] *= norm;
        amax = std::max(amax, std::fabs(y[c]));
      }
      const float s = std::max(amax, 1e-12f) / 127.f;
      scale[r] = s;
      const Vec sv(s), low(-127.f), high(127.f);
      int8_t* out = q + r * k;
      c = 0;
#if defined(CPU_CAPABILITY_AVX512)
      for (; c + kLanes <= k; c += kLanes) {   // the conversion rounds half to even, as torch.round
        const __m512 v = at::vec::clamp(Vec::loadu(y.data() + c) / sv, low, high);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
      }
#endif
      for (; c < k; ++c) out[c] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(y[c] / s))));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotate_quantize(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rotate_quantize: x must be a contiguous [rows, K] tensor");
  TORCH_CHECK(block >= 1 && (block & (block - 1)) == 0 && x.size(1) % block == 0,
              "rotate_quantize: block ", block, " must be a power of two dividing K = ", x.size(1));
  const int64_t rows = x.size(0), k = x.size(1);
  auto q = at::empty({rows, k}, x.options().dtype(at::kChar));
  auto scale = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat) {
    rotate_rows(x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), rows, k, block);
  } else if (x.scalar_type() == at::kBFloat16) {
    rotate_rows(x.data_ptr<at::BFloat16>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), rows, k, block);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kHalf, "rotate_quantize: x must be float32, bfloat16 or float16");
    rotate_rows(x.data_ptr<at::Half>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), rows, k, block);
  }
  return {q, scale};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotate_quantize", &rotate_quantize, "rows rotated by block Hadamard matrices and quantized to int8");
}
