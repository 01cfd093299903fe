// Paged decode attention on AMX tiles, for a bfloat16 cache and query (included by cpu_attention.cpp, which
// dispatches here when the CPU has AMX-BF16 and the shapes fit; its comment gives the contract).
//
// Per request and KV head, 32 cache positions a step (two 16-row pieces, each within one block):
//   scores^T [16 positions, group] = K [16, DIM] x Q^T [DIM, group] per piece. K's rows are the A operand as they
//   lie in the pool: no transpose (a K transposed into the dot instruction's pair layout cost about as much as
//   the dots it saved) and no tree of shuffles summing each position's products, where the vector path spends
//   its time. Q^T is packed into pairs once per request.
//   The online softmax runs per query head on two 16-lane vectors, once per 32 positions.
//   out [group, DIM] += P [group, 32] x V [32, DIM], V's rows interleaved in pairs of positions (unpacks), P
//   rounded to bfloat16 as the vector path and flash attention do; two products in flight before a result is
//   read back, since reading a tile waits for its product.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "amx.h"
#include "cpu_vec.h"
#include "task_balance.h"

namespace batchrun {

#if BATCHRUN_AMX_BUILD
// Tile registers by role: macros, since GCC's tile intrinsics paste their operand into the instruction's text.
// The K and V operands share one shape (16 rows of 64 bytes), so the second piece's K and the second V share a
// register.
#define BATCHRUN_KEYS_TILE 0
#define BATCHRUN_SCORES_TILE 1
#define BATCHRUN_QUERY_TILE 2
#define BATCHRUN_OUT_TILE 3
#define BATCHRUN_PROBS_TILE 4
#define BATCHRUN_ROWS2_TILE 5
#define BATCHRUN_SCORES2_TILE 6
#define BATCHRUN_OUT2_TILE 7
constexpr int64_t kTileRows = 16, kStep = 2 * kTileRows;

// Shapes of every role for a query group of `group` heads (<= 16).
inline void configure_tiles(int group) {
  TileConfig config;
  config.set(BATCHRUN_KEYS_TILE, kTileRows, 64);      // 16 positions x 32 dims of K; or 16 position pairs x 16 dims of V
  config.set(BATCHRUN_ROWS2_TILE, kTileRows, 64);
  config.set(BATCHRUN_QUERY_TILE, kTileRows, 4 * group);    // 32 dims of Q^T as 16 dim pairs x group
  config.set(BATCHRUN_SCORES_TILE, kTileRows, 4 * group);   // scores^T of a piece, float32
  config.set(BATCHRUN_SCORES2_TILE, kTileRows, 4 * group);
  config.set(BATCHRUN_PROBS_TILE, group, 2 * kStep);        // P: group x 32 positions, bfloat16
  config.set(BATCHRUN_OUT_TILE, group, 64);                 // group x 16 dims, float32
  config.set(BATCHRUN_OUT2_TILE, group, 64);
  config.load();
}

// The first slot of the 16 positions from `pos` (a multiple of 16; block_size a multiple of 16).
inline int64_t piece_slot(const int64_t* table, int64_t pos, int64_t block_size) {
  return table[pos / block_size] * block_size + pos % block_size;
}

// scale, window and softcap as in decode_attention; acc ends in bf16_slot order.
template <int DIM>
void decode_attention_amx(const at::BFloat16* q_ptr, const at::BFloat16* k_ptr, const at::BFloat16* v_ptr,
                          const int64_t* tables, const int64_t* lens, int64_t batch, int64_t heads, int64_t kv_heads,
                          int64_t block_size, int64_t width, float scale, int64_t window, float softcap,
                          at::BFloat16* out_ptr) {
  static_assert(DIM % 32 == 0);
  constexpr int kWords = DIM / 32, kVecs = DIM / 16;
  const int64_t group = heads / kv_heads, token_stride = kv_heads * DIM;
  const TaskPlan plan = balance_tasks(lens, batch, kv_heads, window);
  const int64_t split = plan.split, task_heads = kv_heads / split;
  const Vec score_scale(scale), neg_inf(-std::numeric_limits<float>::infinity()), cap(softcap);
  const int64_t row_bytes = token_stride * static_cast<int64_t>(sizeof(at::BFloat16));

  at::parallel_for(0, plan.threads(), 1, [&](int64_t begin, int64_t end) {
    configure_tiles(static_cast<int>(group));
    const int64_t qheads = task_heads * group;
    // Q^T per KV head: [word][dim pair][query head] pairs of bfloat16, the B operand of the score product
    std::vector<uint32_t> q_pairs(task_heads * kWords * kTileRows * group);
    std::vector<float> acc(qheads * DIM), top(qheads), ordered(DIM), scores(kStep * group);
    std::vector<Vec> sums(qheads);   // the softmax's running sums in 16 lanes: one reduction per request
    alignas(64) float part[2 * kTileRows * kTileRows];
    alignas(64) at::BFloat16 probs[kTileRows * kStep];
    alignas(64) __m512i v_pairs[kStep / 2 * kVecs];
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(static_cast<int>(group)));
    for (int64_t i = plan.offsets[begin]; i < plan.offsets[end]; ++i) {
      const int64_t task = plan.order[i], b = task / split, h_lo = (task % split) * task_heads, end_pos = lens[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, end_pos - window) : 0;
      const uint32_t* q_words = reinterpret_cast<const uint32_t*>(q_ptr + (b * heads + h_lo * group) * DIM);
      for (int64_t qh = 0; qh < qheads; ++qh) {
        const int64_t h = qh / group, g = qh % group;
        for (int64_t pair = 0; pair < DIM / 2; ++pair) {
          q_pairs[((h * kWords + pair / kTileRows) * kTileRows + pair % kTileRows) * group + g] =
              q_words[qh * DIM / 2 + pair];
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
      std::fill(sums.begin(), sums.end(), Vec(0.f));
      const int64_t* table = tables + b * width;
      for (int64_t start = lo / kStep * kStep; start < end_pos; start += kStep) {
        // positions start + [first, last) are in the context (and the window); the others of the 32 are masked.
        // The second piece is read only when it holds context (its block may not exist otherwise); rows past
        // `last` may be unwritten (NaN): their scores are replaced and their values zeroed.
        const int64_t first = std::max<int64_t>(lo - start, 0), last = std::min<int64_t>(end_pos - start, kStep);
        const uint64_t valid = ((uint64_t{1} << last) - 1) & ~((uint64_t{1} << first) - 1);
        const bool second = last > kTileRows;
        const int64_t slot = piece_slot(table, start, block_size);
        const int64_t slot2 = second ? piece_slot(table, start + kTileRows, block_size) : slot;
        for (int64_t next = start + kStep; next < std::min(start + 2 * kStep, end_pos); next += kTileRows) {
          prefetch_rows(k_ptr, v_ptr, piece_slot(table, next, block_size), kTileRows, token_stride, h_lo * DIM,
                        task_heads * DIM * 2);   // the next step's rows, while this one computes
        }
        for (int64_t h = h_lo; h < h_lo + task_heads; ++h) {
          const at::BFloat16* k_rows = k_ptr + slot * token_stride + h * DIM;
          const at::BFloat16* k_rows2 = k_ptr + slot2 * token_stride + h * DIM;
          const uint32_t* q_head = q_pairs.data() + (h - h_lo) * kWords * kTileRows * group;
          _tile_zero(BATCHRUN_SCORES_TILE);
          _tile_zero(BATCHRUN_SCORES2_TILE);
          for (int c = 0; c < kWords; ++c) {
            _tile_loadd(BATCHRUN_QUERY_TILE, q_head + c * kTileRows * group, 4 * group);
            _tile_loadd(BATCHRUN_KEYS_TILE, k_rows + 32 * c, row_bytes);
            _tile_dpbf16ps(BATCHRUN_SCORES_TILE, BATCHRUN_KEYS_TILE, BATCHRUN_QUERY_TILE);
            if (second) {
              _tile_loadd(BATCHRUN_ROWS2_TILE, k_rows2 + 32 * c, row_bytes);
              _tile_dpbf16ps(BATCHRUN_SCORES2_TILE, BATCHRUN_ROWS2_TILE, BATCHRUN_QUERY_TILE);
            }
          }
          _tile_stored(BATCHRUN_SCORES_TILE, scores.data(), 4 * group);
          _tile_stored(BATCHRUN_SCORES2_TILE, scores.data() + kTileRows * group, 4 * group);
          // V rows as position pairs, each piece by bf16_pair_rows (rows from `last` on zero, and not read)
          bf16_pair_rows<DIM>(v_ptr + slot * token_stride + h * DIM, token_stride,
                              std::min<int64_t>(last, kTileRows), v_pairs);
          bf16_pair_rows<DIM>(v_ptr + slot2 * token_stride + h * DIM, token_stride,
                              std::max<int64_t>(last - kTileRows, 0), v_pairs + kTileRows / 2 * kVecs);
          float rescale[kTileRows];
          for (int64_t g = 0; g < group; ++g) {
            const int64_t qh = (h - h_lo) * group + g;
            const __m512i index = _mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>(g)));
            Vec s1 = Vec(_mm512_i32gather_ps(index, scores.data(), 4)) * score_scale;
            Vec s2 = Vec(_mm512_i32gather_ps(index, scores.data() + kTileRows * group, 4)) * score_scale;
            if (softcap > 0) s1 = cap * (s1 / cap).tanh(), s2 = cap * (s2 / cap).tanh();
            s1 = Vec(_mm512_mask_blend_ps(static_cast<__mmask16>(valid), neg_inf, s1));
            s2 = Vec(_mm512_mask_blend_ps(static_cast<__mmask16>(valid >> kTileRows), neg_inf, s2));
            const float new_top = std::max(top[qh], at::vec::maximum(s1, s2).reduce_max());
            // exp_u20 (20 ulp, as torch's CPU flash attention uses): P is rounded to bfloat16 next
            const Vec p1 = (s1 - Vec(new_top)).exp_u20(), p2 = (s2 - Vec(new_top)).exp_u20();
            rescale[g] = std::exp(top[qh] - new_top);   // 0 on the first positions (top = -inf)
            top[qh] = new_top;
            sums[qh] = at::vec::fmadd(sums[qh], Vec(rescale[g]), p1 + p2);
            _mm512_store_si512(probs + g * kStep, (__m512i)_mm512_cvtne2ps_pbh(p2, p1));
          }
          _tile_loadd(BATCHRUN_PROBS_TILE, probs, 2 * kStep);
          for (int j = 0; j < kVecs; j += 2) {   // two products in flight before either result is read back
            _tile_zero(BATCHRUN_OUT_TILE);
            _tile_loadd(BATCHRUN_KEYS_TILE, v_pairs + j, kVecs * 64);
            _tile_dpbf16ps(BATCHRUN_OUT_TILE, BATCHRUN_PROBS_TILE, BATCHRUN_KEYS_TILE);
            _tile_zero(BATCHRUN_OUT2_TILE);
            _tile_loadd(BATCHRUN_ROWS2_TILE, v_pairs + j + 1, kVecs * 64);
            _tile_dpbf16ps(BATCHRUN_OUT2_TILE, BATCHRUN_PROBS_TILE, BATCHRUN_ROWS2_TILE);
            _tile_stored(BATCHRUN_OUT_TILE, part, 64);
            _tile_stored(BATCHRUN_OUT2_TILE, part + kTileRows * kTileRows, 64);
            for (int half = 0; half < 2; ++half) {
              for (int64_t g = 0; g < group; ++g) {
                float* a = acc.data() + ((h - h_lo) * group + g) * DIM + 16 * (j + half);
                const float* sum = part + half * kTileRows * kTileRows + 16 * g;
                at::vec::fmadd(Vec::loadu(a), Vec(rescale[g]), Vec::loadu(sum)).store(a);
              }
            }
          }
        }
      }
      for (int64_t qh = 0; qh < qheads; ++qh) {   // back from the pair layout's element order, normalised
        const float* a = acc.data() + qh * DIM;
        for (int64_t i = 0; i < DIM; ++i) ordered[bf16_slot(i)] = a[i];
        at::BFloat16* o = out_ptr + (b * heads + h_lo * group + qh) * DIM;
        const float inv = 1.f / sums[qh].reduce_add();
        for (int64_t d = 0; d < DIM; d += kLanes) store_float(Vec::loadu(ordered.data() + d) * Vec(inv), o + d);
      }
    }
    _tile_release();
  });
}
#undef BATCHRUN_KEYS_TILE
#undef BATCHRUN_SCORES_TILE
#undef BATCHRUN_QUERY_TILE
#undef BATCHRUN_OUT_TILE
#undef BATCHRUN_PROBS_TILE
#undef BATCHRUN_ROWS2_TILE
#undef BATCHRUN_SCORES2_TILE
#undef BATCHRUN_OUT2_TILE
#else
template <int DIM>
void decode_attention_amx(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, const int64_t*,
                          const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, float,
                          at::BFloat16*) {}
#endif

}  // namespace batchrun
