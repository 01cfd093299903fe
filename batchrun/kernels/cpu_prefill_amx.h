// Paged prefill attention on AMX tiles: one request's chunk of query rows over its context in the paged pool (the
// chunk's own K/V already written there), causal, for a bfloat16 cache and query (included by cpu_attention.cpp;
// its comment gives the pool's layout).
//
// query [L, H, D]: the rows of positions context_len - L .. context_len - 1. Each query row attends to the
// positions up to its own (within the last `window` when window > 0); scale and softcap as in decode.
//
// First, per KV head, the context's K and V are packed from the pool into the tile operands' layouts, once for all
// the rows that read them: K^T as 16 dimension pairs x 16 positions a tile, V as 16 position pairs x 16 dimensions.
// Then each task (16 query rows, with all their query heads or one) runs a flash-attention loop, 64 positions a
// step:
//   scores [16 rows, 64 positions] = Q [16, DIM] x K^T (four tiles), masked only on the tile's diagonal, the online
//   softmax per row on four 16-lane vectors (its sum kept in a vector: one reduction at the end), P rounded to
//   bfloat16 as flash attention does; out [16, DIM] += P [16, 64] x V [64, DIM], 16 dimensions a product.
// What the engine ran before: torch's SDPA over the chunk's fresh K/V, or over a gathered copy of the context after
// a cached prefix. bench/prefill_attention.py, one thread of an Intel Xeon (AMX), SmolLM2's heads (9/3): a 355-token
// prompt 1.31 -> 0.77 ms, 1,024 tokens 5.15 -> 4.42 ms, 512 new after 1,536 cached 9.59 -> 7.22 ms. By instruction
// counts (not profiled) the per-row softmax, not the tile products, takes most of a step.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "cpu_vec.h"
#include "task_balance.h"

namespace batchrun {

#if BATCHRUN_AMX_BUILD
// Tile registers: every role is 16 rows of 64 bytes. The scores' four tiles are free again once stored, and hold
// the output's four 16-dimension products; the query's register takes every other V operand then.
#define BATCHRUN_PF_QUERY 0
#define BATCHRUN_PF_OPERAND 1
#define BATCHRUN_PF_ACC0 2
#define BATCHRUN_PF_ACC1 3
#define BATCHRUN_PF_ACC2 4
#define BATCHRUN_PF_ACC3 5
#define BATCHRUN_PF_PROBS 6
#define BATCHRUN_PF_PROBS2 7
constexpr int64_t kPrefillRows = 16, kPrefillStep = 64;

inline void configure_prefill_tiles() {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) config.set(tile, 16, 64);
  _tile_loadconfig(&config);
}

// The pool's K and V of positions [step x 64, step x 64 + 64) for KV head h, in the tiles' layouts (positions from
// context_len on are zero):
//   keys: [step][piece < 4][word c < DIM / 32][dim pair r < 16][position p < 16] as uint32 (two bfloat16);
//   values: [step][16-dim chunk j < DIM / 16][position pair < 32][dim d < 16][2 positions] as bfloat16.
template <int DIM>
void pack_context(const at::BFloat16* k_ptr, const at::BFloat16* v_ptr, const int64_t* table, int64_t block_size,
                  int64_t token_stride, int64_t h, int64_t step, int64_t context_len, uint32_t* keys,
                  at::BFloat16* values) {
  constexpr int kWords = DIM / 32, kChunks = DIM / 16;
  uint32_t* key_step = keys + step * kPrefillStep * DIM / 2;
  at::BFloat16* value_step = values + step * kPrefillStep * DIM;
  for (int64_t p = 0; p < kPrefillStep; ++p) {
    const int64_t pos = step * kPrefillStep + p, piece = p / 16, col = p % 16;
    const bool real = pos < context_len;
    const int64_t slot = real ? table[pos / block_size] * block_size + pos % block_size : 0;
    const uint32_t* k_words = reinterpret_cast<const uint32_t*>(k_ptr + slot * token_stride + h * DIM);
    const at::BFloat16* v_row = v_ptr + slot * token_stride + h * DIM;
    for (int c = 0; c < kWords; ++c) {
      for (int r = 0; r < 16; ++r) {
        key_step[((piece * kWords + c) * 16 + r) * 16 + col] = real ? k_words[16 * c + r] : 0;
      }
    }
    for (int j = 0; j < kChunks; ++j) {
      for (int d = 0; d < 16; ++d) {
        value_step[((j * 32 + p / 2) * 16 + d) * 2 + p % 2] = real ? v_row[16 * j + d] : at::BFloat16(0.f);
      }
    }
  }
}

// out [16 rows, 64 dims from chunk j0] = P [16, 64 positions] x V: four 16-dimension products, each over the two
// halves of the step's positions, the V operands alternating between two registers so that a load need not wait
// for the product before it.
#define BATCHRUN_PF_VALUE_PRODUCT(acc, j)                                                \
  _tile_zero(acc);                                                                        \
  _tile_loadd(BATCHRUN_PF_OPERAND, step_v + (j) * 1024, 64);                             \
  _tile_dpbf16ps(acc, BATCHRUN_PF_PROBS, BATCHRUN_PF_OPERAND);                           \
  _tile_loadd(BATCHRUN_PF_QUERY, step_v + (j) * 1024 + 512, 64);                         \
  _tile_dpbf16ps(acc, BATCHRUN_PF_PROBS2, BATCHRUN_PF_QUERY);

template <int DIM>
void prefill_attention_amx(const at::BFloat16* q_ptr, const at::BFloat16* k_ptr, const at::BFloat16* v_ptr,
                           const int64_t* table, int64_t rows, int64_t context_len, int64_t heads, int64_t kv_heads,
                           int64_t block_size, float scale, int64_t window, float softcap, at::BFloat16* out_ptr) {
  static_assert(DIM % 64 == 0);
  constexpr int kWords = DIM / 32, kChunks = DIM / 16;
  const int64_t group = heads / kv_heads, token_stride = kv_heads * DIM, prefix = context_len - rows;
  const int64_t steps = (context_len + kPrefillStep - 1) / kPrefillStep;
  const int64_t head_keys = steps * kPrefillStep * DIM / 2, head_values = steps * kPrefillStep * DIM;
  std::vector<uint32_t> keys(kv_heads * head_keys);
  std::vector<at::BFloat16> values(kv_heads * head_values);
  at::parallel_for(0, kv_heads * steps, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / steps;
      pack_context<DIM>(k_ptr, v_ptr, table, block_size, token_stride, h, i % steps, context_len,
                        keys.data() + h * head_keys, values.data() + h * head_values);
    }
  });
  // a task: 16 query rows (a tile) with all their query heads, or one query head where the tiles are too few to
  // keep the threads even; its cost is the positions its last row reads
  const int64_t tiles = (rows + kPrefillRows - 1) / kPrefillRows;
  std::vector<int64_t> reach(tiles);
  for (int64_t t = 0; t < tiles; ++t) reach[t] = prefix + std::min(rows, (t + 1) * kPrefillRows);
  const TaskPlan plan = balance_tasks(reach.data(), tiles, heads, window);
  const int64_t task_heads = heads / plan.split;
  const Vec score_scale(scale), neg_inf(-std::numeric_limits<float>::infinity()), cap(softcap);
  const Vec lane(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);

  at::parallel_for(0, plan.threads(), 1, [&](int64_t begin, int64_t end) {
    configure_prefill_tiles();
    alignas(64) at::BFloat16 query[kPrefillRows * DIM];
    alignas(64) float scores[kPrefillRows * kPrefillStep], part[4 * kPrefillRows * 16];
    alignas(64) at::BFloat16 probs[kPrefillRows * 32], probs2[kPrefillRows * 32];   // positions 0-31, 32-63
    alignas(64) float acc[kPrefillRows * DIM];
    float top[kPrefillRows], rescale[kPrefillRows];
    Vec sums[kPrefillRows];   // per row, the softmax's running sum in 16 lanes (one reduction at the end)
    for (int64_t i = plan.offsets[begin]; i < plan.offsets[end]; ++i) {
      const int64_t task = plan.order[i], t = task / plan.split, row0 = t * kPrefillRows;
      const int64_t n = std::min(kPrefillRows, rows - row0);   // real rows in the tile; the others stay zero
      const int64_t first_pos = prefix + row0, last_pos = first_pos + n - 1;
      const int64_t first_lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      std::memset(probs, 0, sizeof(probs));
      std::memset(probs2, 0, sizeof(probs2));
      for (int64_t qh = (task % plan.split) * task_heads; qh < (task % plan.split + 1) * task_heads; ++qh) {
        const int64_t h = qh / group;
        const uint32_t* head_k = keys.data() + h * head_keys;
        const at::BFloat16* head_v = values.data() + h * head_values;
        for (int64_t r = 0; r < kPrefillRows; ++r) {
          if (r < n) {
            std::memcpy(query + r * DIM, q_ptr + ((row0 + r) * heads + qh) * DIM, DIM * sizeof(at::BFloat16));
          } else {
            std::memset(query + r * DIM, 0, DIM * sizeof(at::BFloat16));
          }
        }
        std::fill(acc, acc + kPrefillRows * DIM, 0.f);
        std::fill(top, top + kPrefillRows, -std::numeric_limits<float>::infinity());
        std::fill(rescale, rescale + kPrefillRows, 1.f);
        std::fill(sums, sums + kPrefillRows, Vec(0.f));
        for (int64_t step = first_lo / kPrefillStep; step * kPrefillStep <= last_pos; ++step) {
          const int64_t step_start = step * kPrefillStep;
          const uint32_t* step_k = head_k + step_start * DIM / 2;
          _tile_zero(BATCHRUN_PF_ACC0);
          _tile_zero(BATCHRUN_PF_ACC1);
          _tile_zero(BATCHRUN_PF_ACC2);
          _tile_zero(BATCHRUN_PF_ACC3);
          for (int c = 0; c < kWords; ++c) {   // scores [16 rows, 64 positions], a 16-position piece a tile
            _tile_loadd(BATCHRUN_PF_QUERY, query + 32 * c, DIM * sizeof(at::BFloat16));
            _tile_loadd(BATCHRUN_PF_OPERAND, step_k + c * 256, 64);
            _tile_dpbf16ps(BATCHRUN_PF_ACC0, BATCHRUN_PF_QUERY, BATCHRUN_PF_OPERAND);
            _tile_loadd(BATCHRUN_PF_OPERAND, step_k + (kWords + c) * 256, 64);
            _tile_dpbf16ps(BATCHRUN_PF_ACC1, BATCHRUN_PF_QUERY, BATCHRUN_PF_OPERAND);
            _tile_loadd(BATCHRUN_PF_OPERAND, step_k + (2 * kWords + c) * 256, 64);
            _tile_dpbf16ps(BATCHRUN_PF_ACC2, BATCHRUN_PF_QUERY, BATCHRUN_PF_OPERAND);
            _tile_loadd(BATCHRUN_PF_OPERAND, step_k + (3 * kWords + c) * 256, 64);
            _tile_dpbf16ps(BATCHRUN_PF_ACC3, BATCHRUN_PF_QUERY, BATCHRUN_PF_OPERAND);
          }
          _tile_stored(BATCHRUN_PF_ACC0, scores, 4 * 64);
          _tile_stored(BATCHRUN_PF_ACC1, scores + 16, 4 * 64);
          _tile_stored(BATCHRUN_PF_ACC2, scores + 32, 4 * 64);
          _tile_stored(BATCHRUN_PF_ACC3, scores + 48, 4 * 64);
          // only the steps on the tile's diagonal (or its rows' window edge) hold positions some row may not read
          const bool masked = step_start + kPrefillStep - 1 > first_pos ||
                              (window > 0 && step_start < last_pos - window + 1);
          for (int64_t r = 0; r < n; ++r) {
            Vec s[4];
            for (int piece = 0; piece < 4; ++piece) {
              s[piece] = Vec::loadu(scores + r * kPrefillStep + 16 * piece) * score_scale;
              if (softcap > 0) s[piece] = cap * (s[piece] / cap).tanh();
            }
            if (masked) {   // positions this row reads: [lo, pos]
              const float pos = static_cast<float>(first_pos + r);
              const Vec hi(pos), lo(window > 0 ? pos - static_cast<float>(window) + 1.f : 0.f);
              for (int piece = 0; piece < 4; ++piece) {
                const Vec at = Vec(static_cast<float>(step_start + 16 * piece)) + lane;
                s[piece] = Vec::blendv(neg_inf, s[piece], (at <= hi) & (at >= lo));
              }
            }
            const float new_top =
                std::max(top[r], at::vec::maximum(at::vec::maximum(s[0], s[1]), at::vec::maximum(s[2], s[3]))
                                     .reduce_max());
            if (new_top == -std::numeric_limits<float>::infinity()) {   // nothing readable yet in this row
              rescale[r] = 1.f;
              std::memset(probs + r * 32, 0, 64);
              std::memset(probs2 + r * 32, 0, 64);
              continue;
            }
            // exp_u20 (20 ulp, as torch's CPU flash attention uses): P is rounded to bfloat16 next
            const Vec top_v(new_top);
            const Vec p0 = (s[0] - top_v).exp_u20(), p1 = (s[1] - top_v).exp_u20();
            const Vec p2 = (s[2] - top_v).exp_u20(), p3 = (s[3] - top_v).exp_u20();
            rescale[r] = std::exp(top[r] - new_top);   // 0 on a row's first positions (top = -inf)
            top[r] = new_top;
            sums[r] = at::vec::fmadd(sums[r], Vec(rescale[r]), (p0 + p1) + (p2 + p3));
            _mm512_store_si512(probs + r * 32, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            _mm512_store_si512(probs2 + r * 32, (__m512i)_mm512_cvtne2ps_pbh(p3, p2));
          }
          _tile_loadd(BATCHRUN_PF_PROBS, probs, 64);
          _tile_loadd(BATCHRUN_PF_PROBS2, probs2, 64);
          const at::BFloat16* step_v = head_v + step_start * DIM;
          for (int j0 = 0; j0 < kChunks; j0 += 4) {
            BATCHRUN_PF_VALUE_PRODUCT(BATCHRUN_PF_ACC0, j0)
            BATCHRUN_PF_VALUE_PRODUCT(BATCHRUN_PF_ACC1, j0 + 1)
            BATCHRUN_PF_VALUE_PRODUCT(BATCHRUN_PF_ACC2, j0 + 2)
            BATCHRUN_PF_VALUE_PRODUCT(BATCHRUN_PF_ACC3, j0 + 3)
            _tile_stored(BATCHRUN_PF_ACC0, part, 64);
            _tile_stored(BATCHRUN_PF_ACC1, part + 256, 64);
            _tile_stored(BATCHRUN_PF_ACC2, part + 512, 64);
            _tile_stored(BATCHRUN_PF_ACC3, part + 768, 64);
            for (int64_t r = 0; r < n; ++r) {
              const Vec keep(rescale[r]);
              for (int jj = 0; jj < 4; ++jj) {
                float* a = acc + r * DIM + 16 * (j0 + jj);
                at::vec::fmadd(Vec::loadu(a), keep, Vec::loadu(part + jj * 256 + r * 16)).store(a);
              }
            }
          }
        }
        for (int64_t r = 0; r < n; ++r) {
          at::BFloat16* o = out_ptr + ((row0 + r) * heads + qh) * DIM;
          const Vec inv(1.f / sums[r].reduce_add());
          for (int64_t d = 0; d < DIM; d += kLanes) store_float(Vec::loadu(acc + r * DIM + d) * inv, o + d);
        }
      }
    }
    _tile_release();
  });
}
#undef BATCHRUN_PF_VALUE_PRODUCT
#undef BATCHRUN_PF_QUERY
#undef BATCHRUN_PF_OPERAND
#undef BATCHRUN_PF_ACC0
#undef BATCHRUN_PF_ACC1
#undef BATCHRUN_PF_ACC2
#undef BATCHRUN_PF_ACC3
#undef BATCHRUN_PF_PROBS
#undef BATCHRUN_PF_PROBS2
#else
template <int DIM>
void prefill_attention_amx(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, const int64_t*, int64_t,
                           int64_t, int64_t, int64_t, int64_t, float, int64_t, float, at::BFloat16*) {}
#endif

}  // namespace batchrun
