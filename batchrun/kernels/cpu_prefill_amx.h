// Paged prefill attention on AMX tiles (cpu_prefill.h gives the contract, the packed context and the softmax they
// share with the AVX512-BF16 kernel): scores [16 rows, 64 positions] = Q [16, DIM] x K^T on four tiles, P [16, 64]
// x V 16 dimensions a product. bench/prefill_attention.py, one thread of an Intel Xeon (AMX), SmolLM2's heads
// (9/3), against torch's SDPA: a 355-token prompt 1.31 -> 0.77 ms, 1,024 tokens 5.15 -> 4.42 ms, 512 new after
// 1,536 cached 9.59 -> 7.22 ms. By instruction counts (not profiled) the per-row softmax, not the tile products,
// takes most of a step.
#pragma once

#include <algorithm>
#include <cstring>
#include <limits>

#include "amx.h"
#include "cpu_prefill.h"

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

inline void configure_prefill_tiles() {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) config.set(tile, 16, 64);
  config.load();
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
                           int64_t block_size, float scale, int64_t window, float softcap, bool causal,
                           at::BFloat16* out_ptr, float* lse) {
  static_assert(DIM % 64 == 0);
  constexpr int kWords = DIM / 32, kChunks = DIM / 16;
  const int64_t group = heads / kv_heads;
  const PackedContext<at::BFloat16, DIM> context(k_ptr, v_ptr, table, block_size, kv_heads, context_len);
  const TaskPlan plan = prefill_tasks(rows, context_len, causal, heads, window);
  const int64_t task_heads = heads / plan.split;
  const PrefillSoftmax softmax(scale, softcap, window);

  at::parallel_for(0, plan.threads(), 1, [&](int64_t begin, int64_t end) {
    configure_prefill_tiles();
    alignas(64) at::BFloat16 query[kPrefillRows * DIM];
    alignas(64) float scores[kPrefillRows * kPrefillStep], part[4 * kPrefillRows * 16];
    alignas(64) at::BFloat16 probs[kPrefillRows * 32], probs2[kPrefillRows * 32];   // positions 0-31, 32-63
    PrefillRows<DIM> task_rows(window, causal);
    float* acc = task_rows.acc;
    for (int64_t i = plan.offsets[begin]; i < plan.offsets[end]; ++i) {
      const int64_t task = plan.order[i];
      task_rows.start_task(task / plan.split, rows, context_len);
      std::memset(probs, 0, sizeof(probs));
      std::memset(probs2, 0, sizeof(probs2));
      for (int64_t qh = (task % plan.split) * task_heads; qh < (task % plan.split + 1) * task_heads; ++qh) {
        const int64_t h = qh / group;
        task_rows.start_head(q_ptr, heads, qh, kPrefillRows, query);   // a whole tile, the rows past n zero
        for (int64_t step = task_rows.first_step(); !task_rows.past(step); ++step) {
          const int64_t step_start = step * kPrefillStep;
          const uint32_t* step_k = context.step_keys(h, step);
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
          task_rows.softmax_step(softmax, scores, step_start, probs, probs2, 32);
          _tile_loadd(BATCHRUN_PF_PROBS, probs, 64);
          _tile_loadd(BATCHRUN_PF_PROBS2, probs2, 64);
          const at::BFloat16* step_v = context.step_values(h, step);
          for (int j0 = 0; j0 < kChunks; j0 += 4) {
            BATCHRUN_PF_VALUE_PRODUCT(BATCHRUN_PF_ACC0, j0)
            BATCHRUN_PF_VALUE_PRODUCT(BATCHRUN_PF_ACC1, j0 + 1)
            BATCHRUN_PF_VALUE_PRODUCT(BATCHRUN_PF_ACC2, j0 + 2)
            BATCHRUN_PF_VALUE_PRODUCT(BATCHRUN_PF_ACC3, j0 + 3)
            _tile_stored(BATCHRUN_PF_ACC0, part, 64);
            _tile_stored(BATCHRUN_PF_ACC1, part + 256, 64);
            _tile_stored(BATCHRUN_PF_ACC2, part + 512, 64);
            _tile_stored(BATCHRUN_PF_ACC3, part + 768, 64);
            for (int64_t r = 0; r < task_rows.n; ++r) {
              const Vec keep(task_rows.rescale[r]);
              for (int jj = 0; jj < 4; ++jj) {
                float* a = acc + r * DIM + 16 * (j0 + jj);
                at::vec::fmadd(Vec::loadu(a), keep, Vec::loadu(part + jj * 256 + r * 16)).store(a);
              }
            }
          }
        }
        task_rows.finish_head(out_ptr, lse, heads, qh);
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
                           int64_t, int64_t, int64_t, int64_t, float, int64_t, float, bool, at::BFloat16*, float*) {}
#endif

}  // namespace batchrun
