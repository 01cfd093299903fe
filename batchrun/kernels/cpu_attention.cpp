// Paged decode attention for the CPU: one query token per request, K/V read where they lie in the paged pool
// (no gather copy), 8-bit codes dequantized in the loop. Built at first use by kernels/cpu_attention.py.
//
// query [B, H, D] float32; k_cache/v_cache [N, block_size, Hkv, D] (float32, float16, bfloat16, int8 or fp8 e4m3);
// k_scale/v_scale [N, block_size, Hkv] float32 for 8-bit codes (undefined otherwise); block_tables [B, W] int64;
// context_lens [B] int64 (the new token included); window W > 0 reads only the last W positions (0: all);
// softcap c > 0 turns scores into c * tanh(scores / c) (0: none). Returns [B, H, D] float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// The row as float32: float rows are read where they lie, others converted into `buffer`.
template <typename T>
inline const float* row_as_float(const T* src, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    to_float(src, buffer, n);
    return buffer;
  }
}

// DIM > 0 fixes head_dim at compile time (fully unrolled, vectorised inner loops); 0 reads it at run time.
template <typename T, int DIM>
void decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                      const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                      int64_t window, double softcap, torch::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = DIM > 0 ? DIM : query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t width = block_tables.size(1);
  const float* q_ptr = query.data_ptr<float>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const float* ks_ptr = k_scale ? k_scale->data_ptr<float>() : nullptr;
  const float* vs_ptr = v_scale ? v_scale->data_ptr<float>() : nullptr;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t token_stride = kv_heads * dim;          // elements between consecutive tokens in a block
  const int64_t block_stride = block_size * token_stride;

  // One task per (request, KV head): its `group` query heads share every K/V row read.
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, buffer(dim), acc(group * dim), qs(group * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, end_pos = lens[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, end_pos - window) : 0, len = end_pos - lo;
      const float* q = q_ptr + (b * heads + h * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) qs[i] = q[i] * static_cast<float>(scale);
      const float cap = static_cast<float>(softcap);
      scores.resize(group * len);
      // Calls visit(i, offset) for the request's positions lo + i (i < len), block by block (no division per
      // row); offset is the element offset of the token's row for KV head h in a cache layer.
      auto for_each_row = [&](auto visit) {
        for (int64_t first = lo; first < end_pos; first = (first / block_size + 1) * block_size) {
          const int64_t base = tables[b * width + first / block_size] * block_stride + (first % block_size) *
                               token_stride + h * dim;
          const int64_t last = std::min(end_pos, (first / block_size + 1) * block_size);
          for (int64_t pos = first, offset = base; pos < last; ++pos, offset += token_stride) visit(pos - lo, offset);
        }
      };
      for_each_row([&](int64_t pos, int64_t offset) {
        const float* row = row_as_float(k_ptr + offset, buffer.data(), dim);
        const float row_scale = ks_ptr ? ks_ptr[offset / dim] : 1.f;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qs.data() + g * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qg[d] * row[d];
          const float score = dot * row_scale;
          scores[g * len + pos] = softcap > 0 ? cap * std::tanh(score / cap) : score;
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float top = *std::max_element(s, s + len);
        for (int64_t pos = 0; pos < len; ++pos) s[pos] = std::exp(s[pos] - top);
        float total = 0.f;
        for (int64_t pos = 0; pos < len; ++pos) total += s[pos];
        const float inv = 1.f / total;
        for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row([&](int64_t pos, int64_t offset) {
        const float* row = row_as_float(v_ptr + offset, buffer.data(), dim);
        const float row_scale = vs_ptr ? vs_ptr[offset / dim] : 1.f;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + pos] * row_scale;
          float* a = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * row[d];
        }
      });
      std::copy(acc.begin(), acc.end(), out_ptr + (b * heads + h * group) * dim);
    }
  });
}

template <typename T>
void dispatch_dim(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                  const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                  int64_t window, double softcap, torch::Tensor& out) {
  switch (query.size(2)) {
    case 64:
      return decode_attention<T, 64>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale,
                                     window, softcap, out);
    case 128:
      return decode_attention<T, 128>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale,
                                      window, softcap, out);
    default:
      return decode_attention<T, 0>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale,
                                    window, softcap, out);
  }
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t window, double softcap) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.is_contiguous(), "query: float32, contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache/v_cache: contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt64 && context_lens.is_contiguous(), "context_lens: int64");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  auto out = torch::empty_like(query);
  switch (k_cache.scalar_type()) {
    case torch::kFloat32:
      dispatch_dim<float>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale,
                                 window, softcap, out);
      break;
    case torch::kFloat16:
      dispatch_dim<at::Half>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale,
                                 window, softcap, out);
      break;
    case torch::kBFloat16:
      dispatch_dim<at::BFloat16>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale,
                                     window, softcap, out);
      break;
    case torch::kInt8:
      dispatch_dim<int8_t>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale,
                                 window, softcap, out);
      break;
    case torch::kFloat8_e4m3fn:
      dispatch_dim<c10::Float8_e4m3fn>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                           scale, window, softcap, out);
      break;
    default:
      TORCH_CHECK(false, "k_cache: unsupported dtype ", k_cache.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention reading K/V in place");
}
