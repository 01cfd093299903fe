// Paged decode attention for the CPU: one query token per request, K/V read where they lie in the paged pool
// (no gather copy), 16-bit rows converted and 8-bit codes dequantized in the loop with ATen's vector types
// (cpu_vec.h), float32 accumulators; a bfloat16 cache and query on AMX tiles where the CPU has them
// (cpu_attention_amx.h). Built at first use by kernels/cpu_attention.py.
//
// query [B, H, D] float32, bfloat16 or float16 (the output's dtype); k_cache/v_cache [N, block_size, Hkv, D]
// (float32, float16, bfloat16, int8 or fp8 e4m3); k_scale/v_scale [N, block_size, Hkv] float32 for 8-bit codes
// (undefined otherwise); block_tables [B, W] int64; context_lens [B] int64 (the new token included); window W > 0
// reads only the last W positions (0: all); softcap c > 0 turns scores into c * tanh(scores / c) (0: none).
// starts [B] int64, where given: request b reads its positions from starts[b] on (the engine attends a prefix that
// several requests share once for all of them: paged_prefill_attention, not causal), and its log-sum-exp per query
// head comes back in lse [B, H] float32 so that the two parts merge.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_attention_amx.h"
#include "cpu_cache_write.h"
#include "cpu_prefill.h"
#include "cpu_prefill_amx.h"
#include "cpu_vec.h"
#include "task_balance.h"

namespace {

using batchrun::kLanes;
using batchrun::padded;

// One call's operands, as the binding received them (see the top of this file).
struct DecodeCall {
  const torch::Tensor &query, &k_cache, &v_cache;
  const c10::optional<torch::Tensor>&k_scale, &v_scale;
  const torch::Tensor &block_tables, &context_lens;
  const int64_t* starts;   // null: every position
  double scale;
  int64_t window;
  double softcap;
  torch::Tensor& out;
  float* lse;              // null: not wanted
};

// DIM > 0 fixes head_dim at compile time (unrolled inner loops, accumulators in registers); 0 reads it at run
// time. T: the cache's element type, Q: the query's and output's.
//
// One pass over each request's blocks with an online softmax (running max and sum per query head, the output
// accumulator rescaled when the max grows), so K and V of a block are read together, once. Positions go kLanes at
// a time: a query head's kLanes dot products stay vectors until one tree of deinterleaves (sum_each) turns them
// into one vector of scores, where a horizontal sum per position cost a reduction each. A task is a request with
// all its KV heads (its blocks are then read as contiguous runs) or one (request, KV head), dealt out to the
// threads by its context (task_balance.h).
template <typename T, typename Q, int DIM>
void decode_attention(const DecodeCall& call) {
  const auto& [query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, starts, scale, window, softcap,
               out, lse] = call;
  using batchrun::Vec;
  const int64_t batch = query.size(0), heads = query.size(1), dim = DIM > 0 ? DIM : query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t width = block_tables.size(1), pdim = DIM > 0 ? padded(DIM) : padded(dim), chunks = pdim / kLanes;
  const Q* q_ptr = query.data_ptr<Q>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const float* ks_ptr = k_scale ? k_scale->data_ptr<float>() : nullptr;
  const float* vs_ptr = v_scale ? v_scale->data_ptr<float>() : nullptr;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  Q* out_ptr = out.data_ptr<Q>();
  const int64_t token_stride = kv_heads * dim;          // elements between consecutive tokens in a block
  const float cap = static_cast<float>(softcap);
  const Vec neg_inf(-std::numeric_limits<float>::infinity());
  // float32 rows whose length is whole vectors are read in place; others are converted, kLanes rows at a time,
  // into a float32 buffer that every query head of the group then reads.
  constexpr bool kInPlace = std::is_same_v<T, float> && DIM > 0 && DIM % kLanes == 0;
  constexpr int64_t kChunks = DIM > 0 ? (DIM + kLanes - 1) / kLanes : 1;
  // bfloat16 queries and cache on a CPU with AVX512-BF16: scores straight from the 16-bit rows (bf16_dots)
  constexpr bool kDots = batchrun::kBf16Dots && std::is_same_v<T, at::BFloat16> && std::is_same_v<Q, at::BFloat16> &&
                         DIM > 0 && DIM % 32 == 0;
  const Vec score_scale(kDots ? static_cast<float>(scale) : 1.f);   // otherwise folded into the float query
#if BATCHRUN_AMX_BUILD   // (the AMX names exist only in such a build: a discarded branch still looks them up)
  if constexpr (kDots && DIM % 64 == 0) {   // the scores on AMX tiles, where the CPU has them
    if (starts == nullptr && batchrun::amx_ready() && block_size % batchrun::kTileRows == 0 &&
        group <= batchrun::kTileRows) {
      return batchrun::decode_attention_amx<DIM>(
          reinterpret_cast<const at::BFloat16*>(q_ptr), reinterpret_cast<const at::BFloat16*>(k_ptr),
          reinterpret_cast<const at::BFloat16*>(v_ptr), tables, lens, batch, heads, kv_heads, block_size, width,
          static_cast<float>(scale), window, cap, reinterpret_cast<at::BFloat16*>(out_ptr));
    }
  }
#endif
  const batchrun::TaskPlan plan = batchrun::balance_tasks(lens, batch, kv_heads, window, at::get_num_threads(), starts);
  const int64_t split = plan.split, task_heads = kv_heads / split;

  at::parallel_for(0, plan.threads(), 1, [&](int64_t begin, int64_t end) {
    const int64_t qheads = task_heads * group;
    std::vector<float> qs(qheads * pdim), acc(qheads * pdim), top(qheads), total(qheads);
    std::vector<float> k_rows(kLanes * pdim, 0.f), v_rows(kLanes * pdim, 0.f), probs(group * kLanes), ordered(pdim);
    float k_scales[kLanes], v_scales[kLanes];
    Vec part[kLanes];
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    __m512i v_pairs[kLanes / 2 * (DIM > 0 ? (DIM + 15) / 16 : 1)];
#else
    void* v_pairs = nullptr;
#endif
    auto first_position = [&](int64_t b) {
      return std::max<int64_t>(window > 0 ? lens[b] - window : 0, starts != nullptr ? starts[b] : 0);
    };
    // The element offset of row `row` of KV head h_lo + `head` in the block the thread reads after the one that
    // ends at block_end in its task i: the request's next block or, after its last, its next task's first block
    // (-1: none). A request's blocks lie anywhere in the pool, so the hardware prefetcher cannot run ahead across
    // them; each head's rows of that block are prefetched while the same head's rows here are read. On the
    // bfloat16 dot path a row at a time between the reads (the rows' burst stalled the core there: cold layers,
    // two threads, AMD EPYC, SmolLM2's heads, 32 requests x 150-300 positions, median of 6: 546 -> 477 us); on the
    // other paths in one burst (a row at a time measured slower with int8 codes). Before, a request's first block
    // came unprefetched: 32 requests x 24-48 positions, 16 KV heads: bfloat16 424 -> 344 us, int8 450 -> 376.
    auto next_rows = [&](int64_t i, int64_t b, int64_t block_end, int64_t head, int64_t row) -> int64_t {
      if (block_end < lens[b]) {
        return (tables[b * width + block_end / block_size] * block_size + row) * token_stride +
               ((plan.order[i] % split) * task_heads + head) * dim;
      }
      if (i + 1 >= plan.offsets[end]) return -1;
      const int64_t task = plan.order[i + 1], next_b = task / split, lo = first_position(next_b);
      return (tables[next_b * width + lo / block_size] * block_size + row) * token_stride +
             ((task % split) * task_heads + head) * dim;
    };
    for (int64_t i = plan.offsets[begin]; i < plan.offsets[end]; ++i) {
      const int64_t task = plan.order[i], b = task / split, h_lo = (task % split) * task_heads, end_pos = lens[b];
      const int64_t lo = first_position(b);
      const Q* q_row = q_ptr + (b * heads + h_lo * group) * dim;
      for (int64_t g = 0; g < qheads && !kDots; ++g) {   // the query once to float32, scale folded in
        batchrun::row_to_float(q_row + g * dim, qs.data() + g * pdim, dim, static_cast<float>(scale));
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.f);
      const int64_t* table = tables + b * width;
      for (int64_t first = lo; first < end_pos;) {
        const int64_t block_end = std::min(end_pos, (first / block_size + 1) * block_size);
        const int64_t slot0 = table[first / block_size] * block_size + first % block_size;
        for (int64_t i0 = 0; i0 < block_end - first; i0 += kLanes) {   // kLanes positions at a time
          const int64_t n = std::min(kLanes, block_end - first - i0), slot = slot0 + i0;
          for (int64_t h = h_lo; h < h_lo + task_heads; ++h) {
            // this head's rows of the block read next (next_rows); the bfloat16 dot path prefetches them itself
            const T* next_k = nullptr;
            const T* next_v = nullptr;
            if (const int64_t next = next_rows(i, b, block_end, h - h_lo, i0); next >= 0) {
              next_k = k_ptr + next, next_v = v_ptr + next;
              if constexpr (!kDots) {
                batchrun::prefetch_rows(k_ptr, v_ptr, 0, n, token_stride, next, dim * static_cast<int64_t>(sizeof(T)));
              }
            }
            const T* k_src = k_ptr + slot * token_stride + h * dim;
            const T* v_src = v_ptr + slot * token_stride + h * dim;
            const float* k_f = nullptr;
            int64_t k_ld = 0;
            if constexpr (kInPlace) {
              k_f = reinterpret_cast<const float*>(k_src), k_ld = token_stride;
            } else if constexpr (!kDots) {
              for (int64_t r = 0; r < n; ++r) {
                batchrun::row_to_float(k_src + r * token_stride, k_rows.data() + r * pdim, dim);
              }
              k_f = k_rows.data(), k_ld = pdim;
            }
            if (ks_ptr != nullptr) {   // 8-bit: the row's scale multiplies the dot product, not each code
              for (int64_t r = 0; r < n; ++r) {
                k_scales[r] = ks_ptr[(slot + r) * kv_heads + h], v_scales[r] = vs_ptr[(slot + r) * kv_heads + h];
              }
            }
            for (int64_t g = 0; g < group; ++g) {
              const int64_t qh = (h - h_lo) * group + g;
              const float* qg = qs.data() + qh * pdim;
              if constexpr (kDots) {
                batchrun::bf16_dots<DIM>(reinterpret_cast<const at::BFloat16*>(q_row) + qh * dim,
                                         reinterpret_cast<const at::BFloat16*>(k_src), token_stride, n, part,
                                         g == 0 ? reinterpret_cast<const at::BFloat16*>(next_k) : nullptr);
              } else if constexpr (DIM > 0) {   // the query head in registers, every loop unrolled
                Vec qv[kChunks];
                for (int64_t c = 0; c < kChunks; ++c) qv[c] = Vec::loadu(qg + c * kLanes);
                for (int64_t r = 0; r < kLanes; ++r) {
                  Vec sum(0.f);
                  if (r < n) {
                    for (int64_t c = 0; c < kChunks; ++c) {
                      sum = at::vec::fmadd(qv[c], Vec::loadu(k_f + r * k_ld + c * kLanes), sum);
                    }
                  }
                  part[r] = sum;
                }
              } else {
                for (int64_t r = 0; r < kLanes; ++r) {
                  Vec sum(0.f);
                  for (int64_t c = 0; r < n && c < chunks; ++c) {
                    sum = at::vec::fmadd(Vec::loadu(qg + c * kLanes), Vec::loadu(k_f + r * k_ld + c * kLanes), sum);
                  }
                  part[r] = sum;
                }
              }
              Vec s = batchrun::sum_each(part) * score_scale;
              if (ks_ptr != nullptr) s = s * Vec::loadu(k_scales, n);
              if (softcap > 0) s = Vec(cap) * (s / Vec(cap)).tanh();
              if (n < kLanes) s = Vec::set(neg_inf, s, n);
              const float new_top = std::max(top[qh], s.reduce_max());
              const Vec p = (s - Vec(new_top)).exp();
              const float rescale = std::exp(top[qh] - new_top);   // 0 on the first positions (top = -inf)
              top[qh] = new_top;
              total[qh] = total[qh] * rescale + p.reduce_add();
              (vs_ptr != nullptr ? p * Vec::loadu(v_scales, n) : p).store(probs.data() + g * kLanes);
              float* a = acc.data() + qh * pdim;
              for (int64_t c = 0; c < chunks; ++c) (Vec::loadu(a + c * kLanes) * Vec(rescale)).store(a + c * kLanes);
            }
            if constexpr (kDots) {   // pairs of positions times bfloat16 probabilities, on the dot instruction
              batchrun::bf16_pair_rows<DIM>(reinterpret_cast<const at::BFloat16*>(v_src), token_stride, n, v_pairs,
                                            reinterpret_cast<const at::BFloat16*>(next_v));
              for (int64_t g = 0; g < group; ++g) {
                batchrun::bf16_accumulate<DIM>(Vec::loadu(probs.data() + g * kLanes), v_pairs,
                                               acc.data() + ((h - h_lo) * group + g) * pdim);
              }
              continue;
            }
            const float* v_f;
            int64_t v_ld;
            if constexpr (kInPlace) {
              v_f = reinterpret_cast<const float*>(v_src), v_ld = token_stride;
            } else {
              for (int64_t r = 0; r < n; ++r) {
                batchrun::row_to_float(v_src + r * token_stride, v_rows.data() + r * pdim, dim);
              }
              v_f = v_rows.data(), v_ld = pdim;
            }
            for (int64_t g = 0; g < group; ++g) {
              const float* p = probs.data() + g * kLanes;
              float* a = acc.data() + ((h - h_lo) * group + g) * pdim;
              if constexpr (DIM > 0) {   // the head's accumulator stays in registers over the positions
                Vec reg[kChunks];
                for (int64_t c = 0; c < kChunks; ++c) reg[c] = Vec::loadu(a + c * kLanes);
                for (int64_t r = 0; r < n; ++r) {
                  const Vec pv(p[r]);
                  for (int64_t c = 0; c < kChunks; ++c) {
                    reg[c] = at::vec::fmadd(pv, Vec::loadu(v_f + r * v_ld + c * kLanes), reg[c]);
                  }
                }
                for (int64_t c = 0; c < kChunks; ++c) reg[c].store(a + c * kLanes);
              } else {
                for (int64_t r = 0; r < n; ++r) batchrun::axpy(p[r], v_f + r * v_ld, a, pdim);
              }
            }
          }
        }
        first = block_end;
      }
      for (int64_t qh = 0; qh < qheads; ++qh) {
        Q* o = out_ptr + (b * heads + h_lo * group + qh) * dim;
        const float* a = acc.data() + qh * pdim;
        const float inv = 1.f / total[qh];
        if (lse != nullptr) lse[b * heads + h_lo * group + qh] = top[qh] + std::log(total[qh]);
        if constexpr (kDots) {   // back from bf16_accumulate's element order
          for (int64_t i = 0; i < dim; ++i) ordered[batchrun::bf16_slot(i)] = a[i];
          a = ordered.data();
        }
        for (int64_t d = 0; d < dim; d += kLanes) {
          batchrun::store_float(Vec::loadu(a + d) * Vec(inv), o + d, std::min(kLanes, dim - d));
        }
      }
    }
  });
}

template <typename T, typename Q>
void dispatch_dim(const DecodeCall& call) {
  switch (call.query.size(2)) {
    case 64:
      return decode_attention<T, Q, 64>(call);
    case 128:
      return decode_attention<T, Q, 128>(call);
    default:
      return decode_attention<T, Q, 0>(call);
  }
}

template <typename T>
void dispatch_query(const DecodeCall& call) {
  switch (call.query.scalar_type()) {
    case torch::kFloat32:
      return dispatch_dim<T, float>(call);
    case torch::kBFloat16:
      return dispatch_dim<T, at::BFloat16>(call);
    case torch::kFloat16:
      return dispatch_dim<T, at::Half>(call);
    default:
      TORCH_CHECK(false, "query: unsupported dtype ", call.query.scalar_type());
  }
}

}  // namespace

// (out, lse): lse [B, H] float32 where `starts` is given, else empty.
std::tuple<torch::Tensor, torch::Tensor> paged_decode_attention(
    torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, c10::optional<torch::Tensor> k_scale,
    c10::optional<torch::Tensor> v_scale, torch::Tensor block_tables, torch::Tensor context_lens,
    c10::optional<torch::Tensor> starts, double scale, int64_t window, double softcap) {
  TORCH_CHECK(query.is_contiguous(), "query: contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache/v_cache: contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt64 && context_lens.is_contiguous(), "context_lens: int64");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  torch::Tensor lse;
  if (starts) {
    TORCH_CHECK(starts->scalar_type() == torch::kInt64 && starts->is_contiguous() &&
                    starts->numel() == context_lens.numel(), "starts: int64, one per request");
    const int64_t* first = starts->data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < starts->numel(); ++b) {
      TORCH_CHECK(first[b] >= 0 && first[b] < lens[b], "starts: each request must read at least one position");
    }
    lse = torch::empty({query.size(0), query.size(1)}, query.options().dtype(torch::kFloat));
  }
  auto out = torch::empty_like(query);
  const DecodeCall call{query, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                        starts ? starts->data_ptr<int64_t>() : nullptr, scale, window, softcap, out,
                        starts ? lse.data_ptr<float>() : nullptr};
  switch (k_cache.scalar_type()) {
    case torch::kFloat32:
      dispatch_query<float>(call);
      break;
    case torch::kFloat16:
      dispatch_query<at::Half>(call);
      break;
    case torch::kBFloat16:
      dispatch_query<at::BFloat16>(call);
      break;
    case torch::kInt8:
      dispatch_query<int8_t>(call);
      break;
    case torch::kFloat8_e4m3fn:
      dispatch_query<c10::Float8_e4m3fn>(call);
      break;
    default:
      TORCH_CHECK(false, "k_cache: unsupported dtype ", k_cache.scalar_type());
  }
  return {out, lse};
}

// One request's prefill chunk, query [L, H, D] bfloat16 or float32 (positions context_len - L .. context_len - 1),
// over its context in a pool of the same dtype (the chunk's K/V written there first): bfloat16 on AMX tiles where
// `tiles` (cpu_prefill_amx.h), else on AVX-512 vectors (cpu_prefill.h). Only where prefill_ready(bfloat16) (tiles:
// prefill_amx_ready()) and head_dim is 64 or 128. Not `causal`: L requests' decode queries, each reading all
// context_len positions (the prefix they share); then lse [L, H] float32 comes back too (else it is empty).
std::tuple<torch::Tensor, torch::Tensor> paged_prefill_attention(torch::Tensor query, torch::Tensor k_cache,
                                                                 torch::Tensor v_cache, torch::Tensor block_table,
                                                                 int64_t context_len, double scale, int64_t window,
                                                                 double softcap, bool tiles, bool causal) {
  const bool bf16 = query.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous tensors");
  TORCH_CHECK((bf16 || query.scalar_type() == torch::kFloat) && k_cache.scalar_type() == query.scalar_type() &&
                  v_cache.scalar_type() == query.scalar_type(), "query and cache: all bfloat16 or all float32");
  TORCH_CHECK(tiles ? bf16 && batchrun::kAmx && batchrun::amx_ready()
                    : bf16 ? batchrun::kPrefillBf16 : batchrun::kPrefillFloat,
              "prefill attention: this CPU or build cannot run it (", tiles ? "AMX, bfloat16" : "AVX-512", ")");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.is_contiguous(), "block_table: int64");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(causal || window == 0, "a window needs causal rows");
  TORCH_CHECK((!causal || rows <= context_len) && context_len > 0 &&
                  (context_len + k_cache.size(1) - 1) / k_cache.size(1) <= block_table.size(0),
              "context_len: more positions than the chunk and its block table hold");
  TORCH_CHECK(dim == 64 || dim == 128, "prefill attention: head_dim 64 or 128, got ", dim);
  auto out = torch::empty_like(query);
  torch::Tensor lse;
  if (!causal) lse = torch::empty({rows, heads}, query.options().dtype(torch::kFloat));
  auto run = [&](auto kernel, auto element) {
    using T = decltype(element);
    kernel(query.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), block_table.data_ptr<int64_t>(), rows,
           context_len, heads, kv_heads, k_cache.size(1), static_cast<float>(scale), window,
           static_cast<float>(softcap), causal, out.data_ptr<T>(), causal ? nullptr : lse.data_ptr<float>());
  };
  using at::BFloat16;
  if (tiles) {
    run(dim == 64 ? batchrun::prefill_attention_amx<64> : batchrun::prefill_attention_amx<128>, BFloat16());
  } else if (bf16) {
#if BATCHRUN_PREFILL_BF16
    run(dim == 64 ? batchrun::prefill_attention_vec<BFloat16, 64> : batchrun::prefill_attention_vec<BFloat16, 128>,
        BFloat16());
#endif
  } else {
    run(dim == 64 ? batchrun::prefill_attention_vec<float, 64> : batchrun::prefill_attention_vec<float, 128>, 0.f);
  }
  return {out, lse};
}

// (split, order, offsets) of balance_tasks, for tests.
std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>> task_plan(const torch::Tensor& context_lens,
                                                                         int64_t kv_heads, int64_t window,
                                                                         int64_t threads) {
  const torch::Tensor lens = context_lens.to(torch::kLong).contiguous();
  batchrun::TaskPlan plan = batchrun::balance_tasks(lens.data_ptr<int64_t>(), lens.size(0), kv_heads, window, threads);
  return {plan.split, plan.order, plan.offsets};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention reading K/V in place");
  m.def("paged_prefill_attention", &paged_prefill_attention, "a prefill chunk over its paged context");
  m.def("write_kv_cache", &batchrun::write_kv_rows, "the step's new K/V rows into their slots, stored as computed");
  m.def("prefill_ready", [](bool bf16) { return bf16 ? batchrun::kPrefillBf16 : batchrun::kPrefillFloat; },
        "whether paged_prefill_attention can run here for bfloat16 (else float32)");
  m.def("prefill_amx_ready", [] { return batchrun::kAmx && batchrun::amx_ready(); },
        "whether paged_prefill_attention can run here on AMX tiles");
  m.def("task_plan", &task_plan, "how decode attention deals its tasks to `threads` threads (for tests)");
}
