// Paged decode attention for the CPU: one query token per request, K/V read where they lie in the paged pool
// (no gather copy), 16-bit rows converted and 8-bit codes dequantized in the loop with ATen's vector types
// (cpu_vec.h), float32 accumulators. Built at first use by kernels/cpu_attention.py.
//
// query [B, H, D] float32, bfloat16 or float16 (the output's dtype); k_cache/v_cache [N, block_size, Hkv, D]
// (float32, float16, bfloat16, int8 or fp8 e4m3); k_scale/v_scale [N, block_size, Hkv] float32 for 8-bit codes
// (undefined otherwise); block_tables [B, W] int64; context_lens [B] int64 (the new token included); window W > 0
// reads only the last W positions (0: all); softcap c > 0 turns scores into c * tanh(scores / c) (0: none).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using batchrun::kLanes;
using batchrun::padded;

// DIM > 0 fixes head_dim at compile time (unrolled inner loops, accumulators in registers); 0 reads it at run
// time. T: the cache's element type, Q: the query's and output's.
template <typename T, typename Q, int DIM>
void decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                      const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                      int64_t window, double softcap, torch::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = DIM > 0 ? DIM : query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t width = block_tables.size(1), pdim = DIM > 0 ? padded(DIM) : padded(dim);
  const Q* q_ptr = query.data_ptr<Q>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const float* ks_ptr = k_scale ? k_scale->data_ptr<float>() : nullptr;
  const float* vs_ptr = v_scale ? v_scale->data_ptr<float>() : nullptr;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  Q* out_ptr = out.data_ptr<Q>();
  const int64_t token_stride = kv_heads * dim;          // elements between consecutive tokens in a block
  const int64_t block_stride = block_size * token_stride;
  const float cap = static_cast<float>(softcap);
  // float32 rows whose length is whole vectors are read in place; others are converted, a block at a time, into
  // a float32 buffer that every query head of the group then reads.
  constexpr bool kInPlace = std::is_same_v<T, float> && DIM > 0 && DIM % kLanes == 0;
  constexpr int64_t kChunks = DIM > 0 ? (DIM + kLanes - 1) / kLanes : 0;

  // One task per (request, KV head): its `group` query heads share every K/V row read (and converted).
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, rows_buf(block_size * pdim), acc(group * pdim), qs(group * pdim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, end_pos = lens[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, end_pos - window) : 0, len = end_pos - lo;
      for (int64_t g = 0; g < group; ++g) {   // the query once to float32, scale folded in
        batchrun::row_to_float(q_ptr + (b * heads + h * group + g) * dim, qs.data() + g * pdim, dim,
                               static_cast<float>(scale));
      }
      scores.resize(group * len);
      // Calls visit(i, rows, ld, scales, n) for each run of n consecutive positions lo + i.. within one block:
      // rows[r * ld] is position lo + i + r as float32 (in place or converted), scales[r] its 8-bit scale or null.
      auto for_each_run = [&](const T* cache, const float* scale_ptr, auto visit) {
        for (int64_t first = lo; first < end_pos; first = (first / block_size + 1) * block_size) {
          const int64_t slot = tables[b * width + first / block_size] * block_size + first % block_size;
          const int64_t n = std::min(end_pos, (first / block_size + 1) * block_size) - first;
          const T* src = cache + slot * token_stride + h * dim;
          const float* scales = scale_ptr ? scale_ptr + slot * kv_heads + h : nullptr;
          if constexpr (kInPlace) {
            visit(first - lo, src, token_stride, scales, n);
          } else {
            for (int64_t r = 0; r < n; ++r) {
              batchrun::row_to_float(src + r * token_stride, rows_buf.data() + r * pdim, dim);
            }
            visit(first - lo, rows_buf.data(), pdim, scales, n);
          }
        }
      };
      for_each_run(k_ptr, ks_ptr, [&](int64_t i, const float* rows, int64_t ld, const float* scales, int64_t n) {
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qs.data() + g * pdim;
          float* s = scores.data() + g * len + i;
          for (int64_t r = 0; r < n; ++r) {
            // 8-bit: the row's scale multiplies the dot product, not each code
            const float score = batchrun::dot(qg, rows + r * ld, pdim) * (scales ? scales[r * kv_heads] : 1.f);
            s[r] = softcap > 0 ? cap * std::tanh(score / cap) : score;
          }
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float inv = 1.f / batchrun::exp_and_sum(s, len, batchrun::max_of(s, len));
        for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_run(v_ptr, vs_ptr, [&](int64_t i, const float* rows, int64_t ld, const float* scales, int64_t n) {
        for (int64_t g = 0; g < group; ++g) {
          const float* p = scores.data() + g * len + i;
          float* a = acc.data() + g * pdim;
          if constexpr (DIM > 0) {   // the head's accumulator stays in registers over the run
            batchrun::Vec reg[kChunks];
            for (int64_t c = 0; c < kChunks; ++c) reg[c] = batchrun::Vec::loadu(a + c * kLanes);
            for (int64_t r = 0; r < n; ++r) {
              const batchrun::Vec pv(p[r] * (scales ? scales[r * kv_heads] : 1.f));
              for (int64_t c = 0; c < kChunks; ++c) {
                reg[c] = at::vec::fmadd(pv, batchrun::Vec::loadu(rows + r * ld + c * kLanes), reg[c]);
              }
            }
            for (int64_t c = 0; c < kChunks; ++c) reg[c].store(a + c * kLanes);
          } else {
            for (int64_t r = 0; r < n; ++r) {
              batchrun::axpy(p[r] * (scales ? scales[r * kv_heads] : 1.f), rows + r * ld, a, pdim);
            }
          }
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        Q* o = out_ptr + (b * heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; d += kLanes) {
          batchrun::store_float(batchrun::Vec::loadu(acc.data() + g * pdim + d), o + d, std::min(kLanes, dim - d));
        }
      }
    }
  });
}

template <typename T, typename Q>
void dispatch_dim(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                  const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                  int64_t window, double softcap, torch::Tensor& out) {
  switch (query.size(2)) {
    case 64:
      return decode_attention<T, Q, 64>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                        scale, window, softcap, out);
    case 128:
      return decode_attention<T, Q, 128>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                         scale, window, softcap, out);
    default:
      return decode_attention<T, Q, 0>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                       scale, window, softcap, out);
  }
}

template <typename T>
void dispatch_query(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                    const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                    const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                    int64_t window, double softcap, torch::Tensor& out) {
  switch (query.scalar_type()) {
    case torch::kFloat32:
      return dispatch_dim<T, float>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale,
                                    window, softcap, out);
    case torch::kBFloat16:
      return dispatch_dim<T, at::BFloat16>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                           scale, window, softcap, out);
    case torch::kFloat16:
      return dispatch_dim<T, at::Half>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                       scale, window, softcap, out);
    default:
      TORCH_CHECK(false, "query: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t window, double softcap) {
  TORCH_CHECK(query.is_contiguous(), "query: contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache/v_cache: contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt64 && context_lens.is_contiguous(), "context_lens: int64");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  auto out = torch::empty_like(query);
  switch (k_cache.scalar_type()) {
    case torch::kFloat32:
      dispatch_query<float>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale, window,
                            softcap, out);
      break;
    case torch::kFloat16:
      dispatch_query<at::Half>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale, window,
                               softcap, out);
      break;
    case torch::kBFloat16:
      dispatch_query<at::BFloat16>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale,
                                   window, softcap, out);
      break;
    case torch::kInt8:
      dispatch_query<int8_t>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale, window,
                             softcap, out);
      break;
    case torch::kFloat8_e4m3fn:
      dispatch_query<c10::Float8_e4m3fn>(query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
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
