// Linear layers on AMX tiles, W packed once at load (amx_linear.py says where and why):
//   bfloat16: out [M, N] = x [M, K] @ W^T (+ bias), bfloat16;
//   int8 (W8A8): out [M, N] = (qx [M, K] @ W^T as int32) x the weight's per-column scale, float32 or bfloat16 (the
//   caller applies the activations' row scale).
//
// Packed layout [N/32][K/G][32 columns][G], G = 2 (bfloat16) or 4 (int8) inputs: each block of 32 output columns
// in the dot instruction's group layout (a 128-byte row holds a group of inputs for each of the 32 columns), so a
// block is one sequential stream, read 2 KiB a step (64 bytes of inputs: the two 16-column B tiles side by side),
// prefetched ahead. Each step multiplies two 16-row tiles of x (its rows as they lie, no copy) by the two weight
// tiles into four 32-bit accumulator tiles: 32 rows x 32 columns. Columns past N are zero in the packed copy and
// not stored.
//
// Many rows (a prefill chunk): the rows go in chunks whose activations stay in L2 (kChunkBytes). Up to kPanelRows
// rows, each column block runs over the chunk's row blocks, the rows read by the streaming tile load where the
// block's weights fit L1 (so they do not evict them). Beyond that, a thread's column blocks go in panels of
// kPanelBytes of weights, each row block over the panel's blocks: the row block's tiles stay in L1 and the weights
// come by the streaming load. One thread of the Xeon below, SmolLM2's four layer products, 30 layers' weights from
// L3, ms a layer against oneDNN's packed product: 32 rows 0.66-0.74 against 0.85-0.90; 256 rows 2.26 against
// 1.98 (2.77 without the panels); 1,034 rows 7.9 against 6.7 (10.3 without the panels, 11.7-class without the
// chunks).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#include "amx.h"

namespace {

constexpr int64_t kCols = 32, kStepBytes = 2048, kRowBytes = 128, kTileBytes = 64;
constexpr int64_t kChunkBytes = 1 << 20, kL1WeightBytes = 36 * 1024, kPanelRows = 128, kPanelBytes = 512 * 1024;

enum class Streamed { kNone, kRows, kWeights };   // which operand's tiles come by the streaming load
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
  config.load();
}

// One tile load, by the streaming load when `streamed`; one dot product, int8 or bfloat16 by T. Macros, since GCC's
// tile intrinsics paste their tile numbers into the instruction's text.
#define BATCHRUN_TILE_LOAD(streamed, tile, ptr, stride) \
  if constexpr (streamed) {                             \
    _tile_stream_loadd(tile, ptr, stride);              \
  } else {                                              \
    _tile_loadd(tile, ptr, stride);                     \
  }
#define BATCHRUN_TILE_DOT(T, acc, rows, weights)   \
  if constexpr (std::is_same_v<T, int8_t>) {       \
    _tile_dpbssd(acc, rows, weights);              \
  } else {                                         \
    _tile_dpbf16ps(acc, rows, weights);            \
  }

// acc [32 rows][32 columns] (float32 for bfloat16 T, int32 for int8) = x's rows [0, 16 or 32) x the packed
// weight's 32 columns.
template <typename T, Streamed STREAM>
void multiply_block(const T* x, int64_t k, const T* w, bool two, void* acc_) {
  constexpr bool stream_rows = STREAM == Streamed::kRows, stream_weights = STREAM == Streamed::kWeights;
  auto* acc = static_cast<int32_t*>(acc_);   // 4-byte elements either way
  _tile_zero(4);
  _tile_zero(5);
  if (two) {
    _tile_zero(6);
    _tile_zero(7);
  }
  constexpr int64_t inputs = kTileBytes / sizeof(T);   // a step's inputs: 32 bfloat16 or 64 int8
  const int64_t steps = k / inputs, x_stride = k * static_cast<int64_t>(sizeof(T));
  const char* weights = reinterpret_cast<const char*>(w);
  for (int64_t s = 0; s < steps; ++s) {
    const char* b = weights + s * kStepBytes;
    for (int64_t line = 0; line < kStepBytes; line += 64) _mm_prefetch(b + kPrefetchAhead + line, _MM_HINT_T0);
    BATCHRUN_TILE_LOAD(stream_weights, 2, b, kRowBytes)
    BATCHRUN_TILE_LOAD(stream_weights, 3, b + kTileBytes, kRowBytes)
    BATCHRUN_TILE_LOAD(stream_rows, 0, x + s * inputs, x_stride)
    BATCHRUN_TILE_DOT(T, 4, 0, 2)
    BATCHRUN_TILE_DOT(T, 5, 0, 3)
    if (two) {
      BATCHRUN_TILE_LOAD(stream_rows, 1, x + 16 * k + s * inputs, x_stride)
      BATCHRUN_TILE_DOT(T, 6, 1, 2)
      BATCHRUN_TILE_DOT(T, 7, 1, 3)
    }
  }
  _tile_stored(4, acc, kCols * 4);
  _tile_stored(5, acc + 16, kCols * 4);
  if (two) {
    _tile_stored(6, acc + 16 * kCols, kCols * 4);
    _tile_stored(7, acc + 16 * kCols + 16, kCols * 4);
  }
}

#undef BATCHRUN_TILE_LOAD
#undef BATCHRUN_TILE_DOT

// The accumulators' 16 columns from `col` of row r as float32.
template <typename T>
__m512 accumulated(const void* acc, int r, int col) {
  const auto* row = static_cast<const int32_t*>(acc) + r * kCols + col;
  if constexpr (std::is_same_v<T, int8_t>) return _mm512_cvtepi32_ps(_mm512_load_si512(row));
  return _mm512_load_ps(reinterpret_cast<const float*>(row));
}

// out's rows [0, rows), columns [0, cols) = acc x scale (if any) + bias (if any), as Out.
template <typename T, typename Out>
void store_block(const void* acc, int rows, int64_t cols, const float* scale, const float* bias, Out* out,
                 int64_t n) {
  const __mmask16 lo_mask = cols >= 16 ? 0xffff : (1u << cols) - 1;
  const __mmask16 hi_mask = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  const __m512 scale_lo = scale ? _mm512_maskz_loadu_ps(lo_mask, scale) : one;
  const __m512 scale_hi = scale ? _mm512_maskz_loadu_ps(hi_mask, scale + 16) : one;
  const __m512 bias_lo = bias ? _mm512_maskz_loadu_ps(lo_mask, bias) : zero;
  const __m512 bias_hi = bias ? _mm512_maskz_loadu_ps(hi_mask, bias + 16) : zero;
  for (int r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_fmadd_ps(accumulated<T>(acc, r, 0), scale_lo, bias_lo);
    const __m512 hi = _mm512_fmadd_ps(accumulated<T>(acc, r, 16), scale_hi, bias_hi);
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_mask_storeu_ps(out + r * n, lo_mask, lo);
      _mm512_mask_storeu_ps(out + r * n + 16, hi_mask, hi);
    } else {
      const __mmask32 mask = cols >= 32 ? 0xffffffffu : (1u << cols) - 1;
      _mm512_mask_storeu_epi16(out + r * n, mask, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

template <typename T, typename Out>
void linear_blocks(const T* x, int64_t m, int64_t k, const T* w, const float* scale, const float* bias, int64_t n,
                   Out* out) {
  const int64_t col_blocks = (n + kCols - 1) / kCols, block_bytes = k * kCols * sizeof(T);
  const int64_t row_bytes = k * sizeof(T), chunk_rows = std::max<int64_t>(64, kChunkBytes / row_bytes / 32 * 32);
  const bool panels = m > kPanelRows, stream_rows = m > 32 && block_bytes <= kL1WeightBytes;
  const int64_t panel_blocks = panels ? std::max<int64_t>(1, kPanelBytes / block_bytes) : 1;
  for (int64_t first = 0; first < m; first += chunk_rows) {
    const int64_t last = std::min(m, first + chunk_rows);
    // Threads split the columns: each reads its share of the weight once for the chunk's rows.
    at::parallel_for(0, col_blocks, 1, [&](int64_t begin, int64_t end) {
      alignas(64) int32_t acc[32 * kCols];
      int configured = -1;
      auto unit = [&](int64_t row, int64_t cb) {   // one row block by one column block
        const int rows = static_cast<int>(std::min<int64_t>(32, last - row)), rows0 = std::min(rows, 16);
        if (configured != rows) {
          configure(rows0, rows - rows0);
          configured = rows;
        }
        const T* block = w + cb * k * kCols;
        if (panels) {
          multiply_block<T, Streamed::kWeights>(x + row * k, k, block, rows > 16, acc);
        } else if (stream_rows) {
          multiply_block<T, Streamed::kRows>(x + row * k, k, block, rows > 16, acc);
        } else {
          multiply_block<T, Streamed::kNone>(x + row * k, k, block, rows > 16, acc);
        }
        const int64_t col = cb * kCols;
        store_block<T, Out>(acc, rows, std::min(kCols, n - col), scale ? scale + col : nullptr,
                            bias ? bias + col : nullptr, out + row * n + col, n);
      };
      for (int64_t panel = begin; panel < end; panel += panel_blocks) {
        const int64_t panel_end = std::min(end, panel + panel_blocks);
        if (panels) {
          for (int64_t row = first; row < last; row += 32) {
            for (int64_t cb = panel; cb < panel_end; ++cb) unit(row, cb);
          }
        } else {
          for (int64_t cb = panel; cb < panel_end; ++cb) {
            for (int64_t row = first; row < last; row += 32) unit(row, cb);
          }
        }
      }
      _tile_release();
    });
  }
}
#endif

}  // namespace

bool ready() { return batchrun::amx_ready(); }

// weight [N, K] bfloat16 or int8, K a multiple of 64 bytes -> the packed layout above.
torch::Tensor pack(const torch::Tensor& weight) {
  const bool int8 = weight.scalar_type() == at::kChar;
  const int64_t group = int8 ? 4 : 2;
  TORCH_CHECK(weight.dim() == 2 && (int8 || weight.scalar_type() == at::kBFloat16) &&
                  weight.size(1) * weight.element_size() % kTileBytes == 0,
              "amx_linear.pack: a [N, K] bfloat16 or int8 weight of a multiple of 64 bytes a row");
  const int64_t n = weight.size(0), k = weight.size(1), col_blocks = (n + kCols - 1) / kCols;
  auto padded = torch::zeros({col_blocks * kCols, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({col_blocks, kCols, k / group, group}).permute({0, 2, 1, 3}).contiguous();
}

namespace {
void check(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && packed.scalar_type() == dtype && x.is_contiguous() &&
                  packed.dim() == 4 && x.size(1) == packed.size(1) * packed.size(3) && n <= packed.size(0) * kCols,
              "amx_linear.", name, ": x [M, K] contiguous and a packed [n, K] weight of its dtype");
  TORCH_CHECK(batchrun::amx_ready(), "amx_linear.", name, ": AMX tiles are not available in this process");
}

torch::Tensor float_vector(const c10::optional<torch::Tensor>& values, int64_t n, const char* what) {
  if (!values) return {};
  TORCH_CHECK(values->numel() == n, "amx_linear: ", what, " of ", values->numel(), " values for ", n, " outputs");
  return values->to(at::kFloat).contiguous();
}
}  // namespace

// x [M, K] bfloat16 contiguous, packed from pack() of an [n, K] bfloat16 weight, bias [n] (any float dtype) or none.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                     const c10::optional<torch::Tensor>& bias) {
  check(x, packed, n, at::kBFloat16, "linear");
  auto out = torch::empty({x.size(0), n}, x.options());
  const auto bias_f32 = float_vector(bias, n, "bias");
#if BATCHRUN_AMX_BUILD
  linear_blocks(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), packed.data_ptr<at::BFloat16>(), nullptr,
                bias ? bias_f32.data_ptr<float>() : nullptr, n, out.data_ptr<at::BFloat16>());
#endif
  return out;
}

// qx [M, K] int8 contiguous, packed from pack() of an [n, K] int8 weight, scale [n] the weight's per-column scale
// -> float32 or bfloat16 [M, n] (out_dtype), without the activations' row scale.
torch::Tensor int8_product(const torch::Tensor& qx, const torch::Tensor& packed, int64_t n,
                           const torch::Tensor& scale, at::ScalarType out_dtype) {
  check(qx, packed, n, at::kChar, "int8_product");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "amx_linear.int8_product: float32 or bfloat16");
  auto out = torch::empty({qx.size(0), n}, qx.options().dtype(out_dtype));
  const auto scale_f32 = float_vector(scale, n, "scale");
#if BATCHRUN_AMX_BUILD
  if (out_dtype == at::kFloat) {
    linear_blocks(qx.data_ptr<int8_t>(), qx.size(0), qx.size(1), packed.data_ptr<int8_t>(),
                  scale_f32.data_ptr<float>(), nullptr, n, out.data_ptr<float>());
  } else {
    linear_blocks(qx.data_ptr<int8_t>(), qx.size(0), qx.size(1), packed.data_ptr<int8_t>(),
                  scale_f32.data_ptr<float>(), nullptr, n, out.data_ptr<at::BFloat16>());
  }
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ready", &ready, "whether this process may use AMX tiles (and this build has them)");
  m.def("pack", &pack);
  m.def("linear", &linear);
  m.def("int8_product", &int8_product);
}
