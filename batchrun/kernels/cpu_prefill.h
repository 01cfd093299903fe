// Paged prefill attention for a bfloat16 or float32 cache and query (the same dtype): one request's chunk of query
// rows over its context in the paged pool (the chunk's own K/V already written there), causal (included by
// cpu_attention.cpp; its comment gives the pool's layout). What the kernels share (the packed context, the task
// plan, the online softmax of a row), and the kernel on AVX-512 vectors (bfloat16 on AVX512-BF16's dot
// instruction, float32 on FMA); cpu_prefill_amx.h runs bfloat16's products on AMX tiles.
//
// query [L, H, D]: the rows of positions context_len - L .. context_len - 1. Each query row attends to the
// positions up to its own (within the last `window` when window > 0); scale and softcap as in decode. Not causal
// (`causal` false), every row reads the whole context instead: the decode queries of several requests over the
// prefix they share (the engine then merges each with its request's own positions by the log-sum-exp `lse`).
//
// First, per KV head, the context's K and V are packed from the pool into the products' layouts, once for all the
// rows that read them, in 32-bit words (a bfloat16 pair or one float32): K^T as words of dimensions x 16 positions,
// V as words of positions x 16 dimensions (for bfloat16, the operand layout of both AMX's tiles and AVX512-BF16's
// dot instruction, which multiply bfloat16 pairs into float32 sums).
// Then each task (16 query rows, with all their query heads or one) runs a flash-attention loop, 64 positions a
// step: scores [16 rows, 64 positions] = Q x K^T, masked only on the rows' diagonal; the online softmax per row on
// four 16-lane vectors (its sum kept in a vector: one reduction at the end), P rounded to bfloat16 as flash attention
// does (float32 keeps it); out [16, DIM] += P x V.
// What the engine runs otherwise: torch's SDPA over the chunk's fresh K/V, or over a gathered copy of the context
// after a cached prefix. bench/prefill_attention.py gives both kernels' times against it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_vec.h"
#include "task_balance.h"

namespace batchrun {

#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kPrefillRows = 16, kPrefillStep = 64;

// Elements of T in a 32-bit word of the packed layouts: 2 bfloat16, 1 float32.
template <typename T>
constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));

// The context's K and V for every KV head, packed from the pool (positions from context_len on are zero), with
// kW = DIM / kPerWord<T> words a row:
//   keys: [head][step][piece < 4][word w < kW][position p < 16] as uint32;
//   values: [head][step][16-dim chunk j < DIM / 16][position word g < 64 / kPerWord][dim d < 16][kPerWord] as T.
// Both live in one buffer, the calling thread's own up to kKeptWords and kept between calls (a fresh allocation
// came zeroed from the system page by page at every call: half the packing time of 1,000 positions), larger ones
// allocated for the call.
constexpr size_t kKeptWords = size_t{4} << 20;

// The calling thread's kept buffer, one for every dtype and head_dim.
inline std::vector<uint32_t>& kept_words() {
  thread_local std::vector<uint32_t> kept;
  return kept;
}

template <typename T, int DIM>
struct PackedContext {
  static constexpr int kPer = kPerWord<T>, kRowWords = DIM / kPer;
  int64_t steps, head_keys, head_values;
  std::vector<uint32_t> own;   // the buffer, where larger than kKeptWords
  uint32_t* keys;
  T* values;

  PackedContext(const T* k_ptr, const T* v_ptr, const int64_t* table, int64_t block_size, int64_t kv_heads,
                int64_t context_len)
      : steps((context_len + kPrefillStep - 1) / kPrefillStep),
        head_keys(steps * kPrefillStep * kRowWords),
        head_values(steps * kPrefillStep * DIM) {
    const size_t words = kv_heads * (head_keys + head_values / kPer);
    std::vector<uint32_t>& buffer = words <= kKeptWords ? kept_words() : own;
    if (buffer.size() < words) buffer.resize(words);
    keys = buffer.data();
    values = reinterpret_cast<T*>(keys + kv_heads * head_keys);
    at::parallel_for(0, kv_heads * steps, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        pack(k_ptr, v_ptr, table, block_size, kv_heads * DIM, i / steps, i % steps, context_len);
      }
    });
  }

  const uint32_t* step_keys(int64_t h, int64_t step) const {
    return keys + h * head_keys + step * kPrefillStep * kRowWords;
  }
  const T* step_values(int64_t h, int64_t step) const {
    return values + h * head_values + step * kPrefillStep * DIM;
  }

 private:
  // one step (64 positions) of head h, 16 positions x 16 words of K at a time transposed in registers, V's rows
  // interleaved in pairs (bfloat16) or copied (float32)
  void pack(const T* k_ptr, const T* v_ptr, const int64_t* table, int64_t block_size, int64_t token_stride,
            int64_t h, int64_t step, int64_t context_len) {
    constexpr int kChunks = DIM / 16, kGroups = kPrefillStep / kPer;
    uint32_t* key_step = keys + h * head_keys + step * kPrefillStep * kRowWords;
    T* value_step = values + h * head_values + step * kPrefillStep * DIM;
    const T* k_rows[kPrefillStep];
    const T* v_rows[kPrefillStep];   // null past the context: zeros
    for (int64_t p = 0; p < kPrefillStep; ++p) {
      const int64_t pos = step * kPrefillStep + p;
      const int64_t offset = (table[std::min(pos, context_len - 1) / block_size] * block_size + pos % block_size) *
                             token_stride + h * DIM;
      k_rows[p] = pos < context_len ? k_ptr + offset : nullptr;
      v_rows[p] = pos < context_len ? v_ptr + offset : nullptr;
    }
    for (int piece = 0; piece < 4; ++piece) {
      for (int w0 = 0; w0 < kRowWords; w0 += 16) {
        __m512i words[16];
        for (int i = 0; i < 16; ++i) {
          const T* row = k_rows[16 * piece + i];
          words[i] = row != nullptr ? _mm512_loadu_si512(row + w0 * kPer) : _mm512_setzero_si512();
        }
        transpose_words(words);
        for (int w = 0; w < 16; ++w) _mm512_storeu_si512(key_step + (piece * kRowWords + w0 + w) * 16, words[w]);
      }
    }
    for (int j = 0; j < kChunks; ++j) {
      for (int g = 0; g < kGroups; ++g) {
        T* dst = value_step + (j * kGroups + g) * 16 * kPer;
        if constexpr (kPer == 2) {   // positions 2g and 2g + 1, element by element
          const __m512i pairs = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
          _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(dims16(v_rows[2 * g], j), pairs,
                                                             dims16(v_rows[2 * g + 1], j)));
        } else {
          _mm512_storeu_si512(dst, v_rows[g] != nullptr ? _mm512_loadu_si512(v_rows[g] + 16 * j)
                                                        : _mm512_setzero_si512());
        }
      }
    }
  }

  // dimensions 16j .. 16j + 15 of a 16-bit row (zero where the row is null) in the low half of a vector
  static __m512i dims16(const T* row, int j) {
    return row != nullptr ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * j)))
                          : _mm512_setzero_si512();
  }

  // 16 x 16 32-bit words transposed in place: r[w] becomes word w of each of the 16 vectors
  static void transpose_words(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {   // within 128-bit lanes: pairs of rows, then groups of four
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {   // r[4k + m], lane L: word 4L + m of rows 4k .. 4k + 3
      r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int half = 0; half < 16; half += 8) {   // then across lanes
      for (int m = 0; m < 4; ++m) {
        t[half + m] = _mm512_shuffle_i32x4(r[half + m], r[half + 4 + m], 0x88);
        t[half + 4 + m] = _mm512_shuffle_i32x4(r[half + m], r[half + 4 + m], 0xdd);
      }
    }
    for (int m = 0; m < 4; ++m) {
      r[m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0x88), r[8 + m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0xdd);
      r[4 + m] = _mm512_shuffle_i32x4(t[4 + m], t[12 + m], 0x88);
      r[12 + m] = _mm512_shuffle_i32x4(t[4 + m], t[12 + m], 0xdd);
    }
  }
};

// A task: 16 query rows with all their query heads, or one query head where the row blocks are too few to keep
// the threads even; its cost is the positions its last row reads.
inline TaskPlan prefill_tasks(int64_t rows, int64_t context_len, bool causal, int64_t heads, int64_t window) {
  const int64_t tiles = (rows + kPrefillRows - 1) / kPrefillRows;
  std::vector<int64_t> reach(tiles);
  for (int64_t t = 0; t < tiles; ++t) {
    reach[t] = causal ? context_len - rows + std::min(rows, (t + 1) * kPrefillRows) : context_len;
  }
  return balance_tasks(reach.data(), tiles, heads, window);
}

// One row's step of the online softmax.
struct PrefillSoftmax {
  Vec scale, cap, neg_inf = Vec(-std::numeric_limits<float>::infinity());
  Vec lane = Vec(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
  float softcap;
  int64_t window;

  PrefillSoftmax(float scale_, float softcap_, int64_t window_)
      : scale(scale_), cap(softcap_), softcap(softcap_), window(window_) {}

  // raw: the row's 64 products with the step's positions (from step_start); masked: whether some of them may lie
  // outside the positions the row at `pos` reads. Writes the probabilities as P (positions 0-31 at lo_half, 32-63
  // at hi_half; 0 where not read) and updates the row's running max, the factor its output is to be multiplied by
  // before this step's products are added, and its running sum.
  template <typename P>
  void row(const float* raw, bool masked, int64_t pos, int64_t step_start, float& top, float& rescale, Vec& sum,
           P* lo_half, P* hi_half) const {
    Vec s[4];
    for (int piece = 0; piece < 4; ++piece) {
      s[piece] = Vec::loadu(raw + 16 * piece) * scale;
      if (softcap > 0) s[piece] = cap * (s[piece] / cap).tanh();
    }
    if (masked) {   // positions this row reads: [lo, pos]
      const Vec hi(static_cast<float>(pos)), lo(window > 0 ? static_cast<float>(pos - window + 1) : 0.f);
      for (int piece = 0; piece < 4; ++piece) {
        const Vec at = Vec(static_cast<float>(step_start + 16 * piece)) + lane;
        s[piece] = Vec::blendv(neg_inf, s[piece], (at <= hi) & (at >= lo));
      }
    }
    const float new_top =
        std::max(top, at::vec::maximum(at::vec::maximum(s[0], s[1]), at::vec::maximum(s[2], s[3])).reduce_max());
    if (new_top == -std::numeric_limits<float>::infinity()) {   // nothing readable yet in this row
      rescale = 1.f;
      std::memset(lo_half, 0, 32 * sizeof(P));
      std::memset(hi_half, 0, 32 * sizeof(P));
      return;
    }
    // exp_u20 (20 ulp, as torch's CPU flash attention uses)
    const Vec top_v(new_top);
    const Vec p0 = (s[0] - top_v).exp_u20(), p1 = (s[1] - top_v).exp_u20();
    const Vec p2 = (s[2] - top_v).exp_u20(), p3 = (s[3] - top_v).exp_u20();
    rescale = std::exp(top - new_top);   // 0 on a row's first positions (top = -inf)
    top = new_top;
    sum = at::vec::fmadd(sum, Vec(rescale), (p0 + p1) + (p2 + p3));
    store(p0, p1, lo_half);
    store(p2, p3, hi_half);
  }

 private:
  static void store(const Vec& a, const Vec& b, float* out) { a.store(out), b.store(out + 16); }
#if defined(__AVX512BF16__)
  static void store(const Vec& a, const Vec& b, at::BFloat16* out) {
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
#endif
};

// A thread's task as it runs: its rows (16 query rows from row0, n of them real, at positions first_pos..last_pos,
// or all at the context's last position where not causal) and, for the query head at hand, each row's output so
// far and its softmax's running max, rescale and sum.
template <int DIM>
struct PrefillRows {
  int64_t window;
  bool causal;
  int64_t row0 = 0, n = 0, first_pos = 0, last_pos = 0;
  alignas(64) float acc[kPrefillRows * DIM];
  float top[kPrefillRows], rescale[kPrefillRows];
  Vec sums[kPrefillRows];   // per row, the softmax's running sum in 16 lanes (one reduction at the end)

  PrefillRows(int64_t window_, bool causal_) : window(window_), causal(causal_) {}

  // the task's rows: row block `block` of `rows` rows over `context_len` positions
  void start_task(int64_t block, int64_t rows, int64_t context_len) {
    row0 = block * kPrefillRows, n = std::min(kPrefillRows, rows - row0);
    first_pos = causal ? context_len - rows + row0 : context_len - 1;
    last_pos = causal ? first_pos + n - 1 : first_pos;
  }
  int64_t position(int64_t r) const { return causal ? first_pos + r : first_pos; }
  // the first step any row reads, and whether a step is past the last
  int64_t first_step() const {
    return (window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0) / kPrefillStep;
  }
  bool past(int64_t step) const { return step * kPrefillStep > last_pos; }
  // only the steps on the rows' diagonal (or their window's edge) hold positions some row may not read
  bool masked(int64_t step_start) const {
    return step_start + kPrefillStep - 1 > first_pos || (window > 0 && step_start < last_pos - window + 1);
  }

  // query head qh's rows into `query` (`count` rows of DIM, those past n zero), the running state reset
  template <typename T>
  void start_head(const T* q_ptr, int64_t heads, int64_t qh, int64_t count, T* query) {
    for (int64_t r = 0; r < count; ++r) {
      if (r < n) {
        std::memcpy(query + r * DIM, q_ptr + ((row0 + r) * heads + qh) * DIM, DIM * sizeof(T));
      } else {
        std::memset(query + r * DIM, 0, DIM * sizeof(T));
      }
    }
    std::fill(acc, acc + kPrefillRows * DIM, 0.f);
    std::fill(top, top + kPrefillRows, -std::numeric_limits<float>::infinity());
    std::fill(rescale, rescale + kPrefillRows, 1.f);
    std::fill(sums, sums + kPrefillRows, Vec(0.f));
  }

  // the step's softmax for each real row: row r's probabilities at lo + r * stride (positions 0-31), hi + r * stride
  template <typename P>
  void softmax_step(const PrefillSoftmax& softmax, const float* scores, int64_t step_start, P* lo, P* hi,
                    int64_t stride) {
    const bool some_masked = masked(step_start);
    for (int64_t r = 0; r < n; ++r) {
      softmax.row(scores + r * kPrefillStep, some_masked, position(r), step_start, top[r], rescale[r], sums[r],
                  lo + r * stride, hi + r * stride);
    }
  }

  // each real row's output, acc / its sum, into out [rows, heads, DIM] at query head qh; its log-sum-exp into
  // lse [rows, heads] where lse is not null
  template <typename T>
  void finish_head(T* out_ptr, float* lse, int64_t heads, int64_t qh) const {
    for (int64_t r = 0; r < n; ++r) {
      T* o = out_ptr + ((row0 + r) * heads + qh) * DIM;
      const float sum = sums[r].reduce_add();
      const Vec inv(1.f / sum);
      for (int64_t d = 0; d < DIM; d += kLanes) store_float(Vec::loadu(acc + r * DIM + d) * inv, o + d);
      if (lse != nullptr) lse[(row0 + r) * heads + qh] = top[r] + std::log(sum);
    }
  }
};

// acc + the products of a broadcast word with a vector of 16 words, summed per lane: float32 on FMA, a bfloat16
// pair on AVX512-BF16's dot instruction.
template <typename T>
__m512 word_products(__m512 acc, __m512i word, __m512i words);
template <>
inline __m512 word_products<float>(__m512 acc, __m512i word, __m512i words) {
  return _mm512_fmadd_ps(_mm512_castsi512_ps(word), _mm512_castsi512_ps(words), acc);
}
#if defined(__AVX512BF16__)
template <>
inline __m512 word_products<at::BFloat16>(__m512 acc, __m512i word, __m512i words) {
  return _mm512_dpbf16_ps(acc, (__m512bh)word, (__m512bh)words);
}
#endif

// Whether prefill_attention_vec<T> runs in this build (BATCHRUN_PREFILL_BF16 for #if: the bfloat16 form does not
// compile without AVX512-BF16).
constexpr bool kPrefillFloat = true;
#if defined(__AVX512BF16__)
#define BATCHRUN_PREFILL_BF16 1
constexpr bool kPrefillBf16 = true;
#else
#define BATCHRUN_PREFILL_BF16 0
constexpr bool kPrefillBf16 = false;
#endif

// The products on AVX-512 vectors, several query rows at a time so that each K or V vector loaded serves them
// all: 16 accumulators, scores of kGroupRows rows x 16 kPieces positions, then outputs of kGroupRows rows x 16
// kPieces dimensions. bfloat16: 4 rows x 64; float32: 8 rows x 32, whose step of K and of V (16 KiB each, twice
// bfloat16's) is then read twice for 16 rows instead of four times.
template <typename T, int DIM>
void prefill_attention_vec(const T* q_ptr, const T* k_ptr, const T* v_ptr, const int64_t* table, int64_t rows,
                           int64_t context_len, int64_t heads, int64_t kv_heads, int64_t block_size, float scale,
                           int64_t window, float softcap, bool causal, T* out_ptr, float* lse) {
  static_assert(DIM % 64 == 0);
  using Context = PackedContext<T, DIM>;
  constexpr int kRowWords = Context::kRowWords, kStepWords = kPrefillStep / Context::kPer;
  constexpr int kChunks = DIM / 16, kGroupRows = sizeof(T) == 4 ? 8 : 4, kPieces = 16 / kGroupRows;
  const int64_t group = heads / kv_heads;
  const Context context(k_ptr, v_ptr, table, block_size, kv_heads, context_len);
  const TaskPlan plan = prefill_tasks(rows, context_len, causal, heads, window);
  const int64_t task_heads = heads / plan.split;
  const PrefillSoftmax softmax(scale, softcap, window);

  at::parallel_for(0, plan.threads(), 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t query[kPrefillRows * kRowWords];   // the rows' query in words
    alignas(64) float scores[kPrefillRows * kPrefillStep];
    alignas(64) T probs[kPrefillRows * kPrefillStep];
    PrefillRows<DIM> task_rows(window, causal);
    float* acc = task_rows.acc;
    const float* rescale = task_rows.rescale;
    const uint32_t* prob_words = reinterpret_cast<const uint32_t*>(probs);
    for (int64_t i = plan.offsets[begin]; i < plan.offsets[end]; ++i) {
      const int64_t task = plan.order[i];
      task_rows.start_task(task / plan.split, rows, context_len);
      const int64_t padded_n = (task_rows.n + kGroupRows - 1) / kGroupRows * kGroupRows;
      std::memset(probs, 0, sizeof(probs));   // rows past n stay zero
      for (int64_t qh = (task % plan.split) * task_heads; qh < (task % plan.split + 1) * task_heads; ++qh) {
        const int64_t h = qh / group;
        task_rows.start_head(q_ptr, heads, qh, padded_n, reinterpret_cast<T*>(query));
        for (int64_t step = task_rows.first_step(); !task_rows.past(step); ++step) {
          const int64_t step_start = step * kPrefillStep;
          const uint32_t* step_k = context.step_keys(h, step);
          for (int64_t r0 = 0; r0 < padded_n; r0 += kGroupRows) {   // scores [rows, 16 kPieces positions]
            for (int p0 = 0; p0 < 4; p0 += kPieces) {
              __m512 s[kGroupRows][kPieces];
              for (int r = 0; r < kGroupRows; ++r) {
                for (int p = 0; p < kPieces; ++p) s[r][p] = _mm512_setzero_ps();
              }
              for (int w = 0; w < kRowWords; ++w) {
                __m512i k[kPieces];
                for (int p = 0; p < kPieces; ++p) k[p] = _mm512_loadu_si512(step_k + ((p0 + p) * kRowWords + w) * 16);
                for (int r = 0; r < kGroupRows; ++r) {
                  const __m512i q = _mm512_set1_epi32(query[(r0 + r) * kRowWords + w]);
                  for (int p = 0; p < kPieces; ++p) s[r][p] = word_products<T>(s[r][p], q, k[p]);
                }
              }
              for (int r = 0; r < kGroupRows; ++r) {
                for (int p = 0; p < kPieces; ++p) {
                  _mm512_store_ps(scores + (r0 + r) * kPrefillStep + 16 * (p0 + p), s[r][p]);
                }
              }
            }
          }
          task_rows.softmax_step(softmax, scores, step_start, probs, probs + 32, kPrefillStep);
          const T* step_v = context.step_values(h, step);
          for (int64_t r0 = 0; r0 < padded_n; r0 += kGroupRows) {   // out [rows, 16 kPieces dims] += P x V
            for (int j0 = 0; j0 < kChunks; j0 += kPieces) {
              __m512 o[kGroupRows][kPieces];
              for (int r = 0; r < kGroupRows; ++r) {
                const __m512 keep = _mm512_set1_ps(rescale[r0 + r]);
                for (int j = 0; j < kPieces; ++j) {
                  o[r][j] = _mm512_mul_ps(_mm512_load_ps(acc + (r0 + r) * DIM + 16 * (j0 + j)), keep);
                }
              }
              for (int g = 0; g < kStepWords; ++g) {
                __m512i v[kPieces];
                for (int j = 0; j < kPieces; ++j) {
                  v[j] = _mm512_loadu_si512(step_v + ((j0 + j) * kStepWords + g) * 16 * Context::kPer);
                }
                for (int r = 0; r < kGroupRows; ++r) {
                  const __m512i p = _mm512_set1_epi32(prob_words[(r0 + r) * kStepWords + g]);
                  for (int j = 0; j < kPieces; ++j) o[r][j] = word_products<T>(o[r][j], p, v[j]);
                }
              }
              for (int r = 0; r < kGroupRows; ++r) {
                for (int j = 0; j < kPieces; ++j) _mm512_store_ps(acc + (r0 + r) * DIM + 16 * (j0 + j), o[r][j]);
              }
            }
          }
        }
        task_rows.finish_head(out_ptr, lse, heads, qh);
      }
    }
  });
}
#else
#define BATCHRUN_PREFILL_BF16 0
constexpr bool kPrefillFloat = false, kPrefillBf16 = false;
template <typename T, int DIM>
void prefill_attention_vec(const T*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                           float, int64_t, float, bool, T*, float*) {}
#endif

}  // namespace batchrun
