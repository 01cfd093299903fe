// bfloat16 linear layers on AMX tiles: out [M, N] = x [M, K] @ W^T (+ bias), W packed once at load
// (amx_linear.py says where and why).
//
// Packed layout [N/32][K/2][32 columns][2]: each block of 32 output columns as the dot instruction's pair layout
// (a row holds an input pair for each of the 32 columns), so a block is one sequential stream, read 2 KiB a step
// (32 inputs: the two 16-column B tiles side by side), prefetched ahead. Each step multiplies two 16-row tiles of
// x (its rows as they lie, no copy) by the two weight tiles into four float32 accumulator tiles: 32 rows x 32
// columns. Columns past N are zero in the packed copy and not stored.
//
// Many rows (a prefill chunk): the rows go in chunks whose activations stay in L2 (kChunkBytes), each chunk over
// every column block; where a block's weights fit L1 the rows are read with the streaming tile load, so they do not
// evict them. On the Xeon below, 1,024 rows: oneDNN's packed product within 0.9-1.3x of this kernel's time on
// SmolLM2's and the 0.3B Llama's shapes (without the chunks 1.5-1.6x), at 256 rows equal or slower.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "amx.h"

namespace {

constexpr int64_t kCols = 32, kInputs = 32, kStepElems = kInputs * kCols, kRowBytes = kCols * 2 * 2;
constexpr int64_t kChunkBytes = 1 << 20, kL1WeightBytes = 36 * 1024;
// Bytes ahead of the tiles being read that each step prefetches: 4 KiB (two steps) cut a decode step's products
// by 8 % against the hardware prefetcher alone (32 rows, SmolLM2's shapes, weights cold).
constexpr int64_t kPrefetchAhead = 4096;

#if BATCHRUN_AMX_BUILD
// Tile registers: 0, 1 rows of x (16 x 32 bfloat16); 2, 3 weight tiles; 4-7 accumulators (16 x 16 float32):
// 4, 5 the first 16 rows by the two column halves, 6, 7 the next 16.
void configure(int rows0, int rows1) {
  batchrun::TileConfig config;
  const int second = std::max(rows1, 1);   // an unused tile still needs a valid shape
  config.set(0, rows0, 64), config.set(1, second, 64);
  config.set(2, 16, 64), config.set(3, 16, 64);
  config.set(4, rows0, 64), config.set(5, rows0, 64), config.set(6, second, 64), config.set(7, second, 64);
  _tile_loadconfig(&config);
}

// acc [32 rows][32 columns] float32 = x's rows [0, 16 or 32) x the packed weight's 32 columns; STREAM: x's tiles
// by the streaming load.
template <bool STREAM>
void multiply_block(const at::BFloat16* x, int64_t k, const at::BFloat16* w, bool two, float* acc) {
  _tile_zero(4);
  _tile_zero(5);
  if (two) {
    _tile_zero(6);
    _tile_zero(7);
  }
  const int64_t steps = k / kInputs, x_stride = k * static_cast<int64_t>(sizeof(at::BFloat16));
  for (int64_t s = 0; s < steps; ++s) {
    const at::BFloat16* b = w + s * kStepElems;
    const char* ahead = reinterpret_cast<const char*>(b) + kPrefetchAhead;
    for (int64_t line = 0; line < kStepElems * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(2, b, kRowBytes);
    _tile_loadd(3, b + 32, kRowBytes);
    if constexpr (STREAM) {
      _tile_stream_loadd(0, x + s * kInputs, x_stride);
    } else {
      _tile_loadd(0, x + s * kInputs, x_stride);
    }
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if (two) {
      if constexpr (STREAM) {
        _tile_stream_loadd(1, x + 16 * k + s * kInputs, x_stride);
      } else {
        _tile_loadd(1, x + 16 * k + s * kInputs, x_stride);
      }
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, acc, kCols * 4);
  _tile_stored(5, acc + 16, kCols * 4);
  if (two) {
    _tile_stored(6, acc + 16 * kCols, kCols * 4);
    _tile_stored(7, acc + 16 * kCols + 16, kCols * 4);
  }
}

// out's rows [0, rows), columns [0, cols) = acc (+ bias), rounded to bfloat16.
void store_block(const float* acc, int rows, int64_t cols, const float* bias, at::BFloat16* out, int64_t n) {
  const __mmask16 lo_mask = cols >= 16 ? 0xffff : (1u << cols) - 1;
  const __mmask16 hi_mask = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  const __m512 bias_lo = bias ? _mm512_maskz_loadu_ps(lo_mask, bias) : _mm512_setzero_ps();
  const __m512 bias_hi = bias ? _mm512_maskz_loadu_ps(hi_mask, bias + 16) : _mm512_setzero_ps();
  const __mmask32 mask = cols >= 32 ? 0xffffffffu : (1u << cols) - 1;
  for (int r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(acc + r * kCols), bias_lo);
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(acc + r * kCols + 16), bias_hi);
    _mm512_mask_storeu_epi16(out + r * n, mask, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
}

void linear_blocks(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* w, const float* bias,
                   int64_t n, at::BFloat16* out) {
  const int64_t col_blocks = (n + kCols - 1) / kCols, block_elems = k * kCols;
  const int64_t chunk_rows = std::max<int64_t>(64, kChunkBytes / (2 * k) / 32 * 32);
  const bool stream = m > 32 && block_elems * 2 <= kL1WeightBytes;
  for (int64_t first = 0; first < m; first += chunk_rows) {
    const int64_t last = std::min(m, first + chunk_rows);
    // Threads split the columns: each reads its share of the weight once for the chunk's rows.
    at::parallel_for(0, col_blocks, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float acc[32 * kCols];
      int configured = -1;
      for (int64_t cb = begin; cb < end; ++cb) {
        const int64_t col = cb * kCols, cols = std::min(kCols, n - col);
        for (int64_t row = first; row < last; row += 32) {
          const int rows = static_cast<int>(std::min<int64_t>(32, last - row)), rows0 = std::min(rows, 16);
          if (configured != rows) {
            configure(rows0, rows - rows0);
            configured = rows;
          }
          if (stream) {
            multiply_block<true>(x + row * k, k, w + cb * block_elems, rows > 16, acc);
          } else {
            multiply_block<false>(x + row * k, k, w + cb * block_elems, rows > 16, acc);
          }
          store_block(acc, rows, cols, bias ? bias + col : nullptr, out + row * n + col, n);
        }
      }
      _tile_release();
    });
  }
}
#endif

}  // namespace

bool ready() { return batchrun::amx_ready(); }

// weight [N, K] bfloat16, K a multiple of 32 -> the packed layout above.
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(1) % kInputs == 0,
              "amx_linear.pack: a [N, K] bfloat16 weight with K a multiple of 32");
  const int64_t n = weight.size(0), k = weight.size(1), col_blocks = (n + kCols - 1) / kCols;
  auto padded = torch::zeros({col_blocks * kCols, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({col_blocks, kCols, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bfloat16 contiguous, packed from pack() of an [n, K] weight, bias [n] (any float dtype) or none.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && packed.dim() == 4 &&
                  x.size(1) == packed.size(1) * 2 && n <= packed.size(0) * kCols,
              "amx_linear.linear: x [M, K] bfloat16 contiguous and a packed [n, K] weight");
  TORCH_CHECK(batchrun::amx_ready(), "amx_linear.linear: AMX tiles are not available in this process");
  auto out = torch::empty({x.size(0), n}, x.options());
  torch::Tensor bias_f32;
  if (bias) {
    TORCH_CHECK(bias->numel() == n, "amx_linear.linear: bias of ", bias->numel(), " values for ", n, " outputs");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
#if BATCHRUN_AMX_BUILD
  linear_blocks(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), packed.data_ptr<at::BFloat16>(),
                bias ? bias_f32.data_ptr<float>() : nullptr, n, out.data_ptr<at::BFloat16>());
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ready", &ready, "whether this process may use AMX tiles (and this build has them)");
  m.def("pack", &pack);
  m.def("linear", &linear);
}
