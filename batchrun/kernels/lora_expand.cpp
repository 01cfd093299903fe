// LoRA's expand on the CPU: out = y + each row's own adapter's h @ B^T, reading only that adapter's B and only its
// nonzero blocks (the parts of a fused q/k/v or gate/up projection), no per-row mask. Built by lora_expand.py.
//
// y [T, out] and h [T, C] may be row-strided views (of the fused base-and-shrink product); out is a new contiguous
// [T, out] tensor. A piece is one PEFT module of one adapter: its output columns [o0, o1), its first column c0 in h,
// its rank r and the offset in the flat `bt` of its B^T block (scaling folded in): [r, o1 - o0] row-major, or, for
// bfloat16 where the CPU has AVX512-BF16 (bf16_pairs()), [ceil(r / 2), o1 - o0, 2]: the rank's pairs interleaved
// as vdpbf16ps reads them, an odd rank's last pair padded with zero. Adapter position p owns pieces first[p] ..
// first[p + 1] - 1, in column order; runs [R, 3] = (first row, end row, adapter position), in row order. Each
// output element is read from y and written once. Accumulates in float32 from y's value and
// rounds once, as oneDNN's product with an added operand does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "cpu_vec.h"

namespace {

using batchrun::kLanes;
using batchrun::load_float;
using batchrun::store_float;
using batchrun::Vec;

constexpr int64_t kVecs = 4;                 // vectors of output columns per row: one block
constexpr int64_t kBlock = kVecs * kLanes;   // output columns one task works on
constexpr int64_t kRows = 4;                 // rows at a time: each B vector loaded once feeds kRows x FMAs

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool kPairs = true;
#else
constexpr bool kPairs = false;
#endif

inline int64_t lanes_of(int64_t lanes, int64_t k) { return std::max<int64_t>(0, std::min(kLanes, lanes - k * kLanes)); }

// Rows [t, t + R) of one block: acc = y, then acc += h_row @ B^T block, rounded once into out. B^T's block is in
// float32 (bf: r x kBlock), h's rows too (hf: rows x r from `start`).
template <int R, typename T>
void rows_f32(const float* hf, const float* bf, int64_t r, int64_t lanes, int64_t t, int64_t start, const T* y,
              int64_t y_stride, T* out, int64_t width) {
  Vec acc[R][kVecs];
  for (int i = 0; i < R; ++i)
    for (int64_t k = 0; k < kVecs; ++k) {
      const int64_t m = lanes_of(lanes, k);
      acc[i][k] = m ? load_float(y + (t + i) * y_stride + k * kLanes, m) : Vec(0.f);
    }
  for (int64_t j = 0; j < r; ++j) {
    Vec b[kVecs];
    for (int64_t k = 0; k < kVecs; ++k) b[k] = Vec::loadu(bf + j * kBlock + k * kLanes);
    for (int i = 0; i < R; ++i) {
      const Vec hj(hf[(t + i - start) * r + j]);
      for (int64_t k = 0; k < kVecs; ++k) acc[i][k] = at::vec::fmadd(hj, b[k], acc[i][k]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int64_t k = 0; k < kVecs; ++k)
      if (const int64_t m = lanes_of(lanes, k)) store_float(acc[i][k], out + (t + i) * width + k * kLanes, m);
}

template <typename T>
void block_f32(const float* hf, const T* b, int64_t n, int64_t r, int64_t col, int64_t start, int64_t end, const T* y,
               int64_t y_stride, T* out, int64_t width, float* bf) {
  const int64_t lanes = std::min(kBlock, n - col);
  for (int64_t j = 0; j < r; ++j)
    for (int64_t k = 0; k < kVecs; ++k) {
      const int64_t m = lanes_of(lanes, k);
      (m ? load_float(b + j * n + col + k * kLanes, m) : Vec(0.f)).store(bf + j * kBlock + k * kLanes);
    }
  int64_t t = start;
  for (; t + kRows <= end; t += kRows) rows_f32<kRows>(hf, bf, r, lanes, t, start, y + col, y_stride, out + col, width);
  for (; t < end; ++t) rows_f32<1>(hf, bf, r, lanes, t, start, y + col, y_stride, out + col, width);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// The bfloat16 way: vdpbf16ps multiplies a pair of h's rank entries (hp: rows x pairs, 32 bits each) by B's pairs
// (b: pairs x n x 2) straight from memory, two multiply-adds a lane per instruction, nothing converted.
template <int R>
void rows_bf16(const uint32_t* hp, const at::BFloat16* b, int64_t n, int64_t pairs, int64_t lanes, int64_t t,
               int64_t start, const at::BFloat16* y, int64_t y_stride, at::BFloat16* out, int64_t width) {
  __m512 acc[R][kVecs];
  __mmask16 mask[kVecs];
  for (int64_t k = 0; k < kVecs; ++k) {
    const int64_t m = lanes_of(lanes, k);
    mask[k] = static_cast<__mmask16>((1u << m) - 1);
    for (int i = 0; i < R; ++i)
      acc[i][k] = m ? __m512(load_float(y + (t + i) * y_stride + k * kLanes, m)) : _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh bv[kVecs];
    for (int64_t k = 0; k < kVecs; ++k)
      bv[k] = (__m512bh)_mm512_maskz_loadu_epi32(mask[k], b + 2 * (j * n + k * kLanes));
    for (int i = 0; i < R; ++i) {
      const __m512bh hj = (__m512bh)_mm512_set1_epi32(static_cast<int>(hp[(t + i - start) * pairs + j]));
      for (int64_t k = 0; k < kVecs; ++k) acc[i][k] = _mm512_dpbf16_ps(acc[i][k], hj, bv[k]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int64_t k = 0; k < kVecs; ++k)
      if (const int64_t m = lanes_of(lanes, k)) store_float(Vec(acc[i][k]), out + (t + i) * width + k * kLanes, m);
}

void block_bf16(const uint32_t* hp, const at::BFloat16* b, int64_t n, int64_t pairs, int64_t col, int64_t start,
                int64_t end, const at::BFloat16* y, int64_t y_stride, at::BFloat16* out, int64_t width) {
  const int64_t lanes = std::min(kBlock, n - col);
  int64_t t = start;
  for (; t + kRows <= end; t += kRows)
    rows_bf16<kRows>(hp, b + 2 * col, n, pairs, lanes, t, start, y + col, y_stride, out + col, width);
  for (; t < end; ++t) rows_bf16<1>(hp, b + 2 * col, n, pairs, lanes, t, start, y + col, y_stride, out + col, width);
}
#endif

// out[rows, cols) = y[rows, cols): rows outside every run and columns none of a run's pieces covers.
template <typename T>
void copy(const T* y, int64_t y_stride, T* out, int64_t width, int64_t start, int64_t end, int64_t col, int64_t stop) {
  for (int64_t t = start; t < end; ++t)
    std::copy(y + t * y_stride + col, y + t * y_stride + stop, out + t * width + col);
}

template <typename T>
void expand(const T* y, int64_t y_stride, const T* h, int64_t h_stride, const T* bt, const int64_t* pieces,
            const int64_t* first, const int64_t* runs, int64_t num_runs, T* out, int64_t rows, int64_t width) {
  std::vector<float> hf;
  std::vector<uint32_t> hp;
  int64_t done = 0;   // rows before this one are written
  for (int64_t run = 0; run < num_runs; ++run) {
    const int64_t start = runs[3 * run], end = runs[3 * run + 1], p = runs[3 * run + 2];
    copy(y, y_stride, out, width, done, start, 0, width);
    done = end;
    int64_t covered = 0;   // columns before this one are written (an adapter's pieces come in column order)
    for (int64_t piece = first[p]; piece < first[p + 1]; ++piece) {
      const int64_t* q = pieces + 5 * piece;
      const int64_t o0 = q[0], n = q[1] - q[0], c0 = q[2], r = q[3];
      const int64_t blocks = (n + kBlock - 1) / kBlock;
      copy(y, y_stride, out, width, start, end, covered, o0);
      covered = q[1];
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        const int64_t pairs = (r + 1) / 2;
        hp.assign((end - start) * pairs, 0);   // an odd rank's last pair: (h, 0)
        for (int64_t t = start; t < end; ++t)
          std::memcpy(hp.data() + (t - start) * pairs, h + t * h_stride + c0, r * sizeof(T));
        at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t stop) {
          for (int64_t block = begin; block < stop; ++block)
            block_bf16(hp.data(), bt + q[4], n, pairs, block * kBlock, start, end, y + o0, y_stride, out + o0, width);
        });
        continue;
      }
#endif
      hf.resize((end - start) * r);
      for (int64_t t = start; t < end; ++t)
        for (int64_t j = 0; j < r; ++j) hf[(t - start) * r + j] = static_cast<float>(h[t * h_stride + c0 + j]);
      at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t stop) {
        std::vector<float> bf(r * kBlock);
        for (int64_t block = begin; block < stop; ++block)
          block_f32(hf.data(), bt + q[4], n, r, block * kBlock, start, end, y + o0, y_stride, out + o0, width,
                    bf.data());
      });
    }
    copy(y, y_stride, out, width, start, end, covered, width);
  }
  copy(y, y_stride, out, width, done, rows, 0, width);
}

torch::Tensor lora_expand(const torch::Tensor& y, const torch::Tensor& h, const torch::Tensor& bt,
                          const torch::Tensor& pieces, const torch::Tensor& first, const torch::Tensor& runs) {
  TORCH_CHECK(y.dim() == 2 && h.dim() == 2 && y.size(0) == h.size(0), "lora_expand: y [T, out] and h [T, C]");
  TORCH_CHECK(y.stride(1) == 1 && h.stride(1) == 1, "lora_expand: y and h need contiguous rows");
  TORCH_CHECK(y.scalar_type() == h.scalar_type() && bt.scalar_type() == y.scalar_type() && bt.is_contiguous(),
              "lora_expand: y, h and bt of one dtype, bt contiguous");
  TORCH_CHECK(pieces.scalar_type() == at::kLong && first.scalar_type() == at::kLong && runs.scalar_type() == at::kLong
              && pieces.is_contiguous() && first.is_contiguous() && runs.is_contiguous(),
              "lora_expand: contiguous int64 tables");
  auto out = torch::empty({y.size(0), y.size(1)}, y.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    expand<T>(y.data_ptr<T>(), y.stride(0), h.data_ptr<T>(), h.stride(0), bt.data_ptr<T>(),
              pieces.data_ptr<int64_t>(), first.data_ptr<int64_t>(), runs.data_ptr<int64_t>(), runs.size(0),
              out.data_ptr<T>(), y.size(0), y.size(1));
  };
  switch (y.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, "lora_expand: float32, bfloat16 or float16, not ", y.scalar_type());
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_expand", &lora_expand, "y + each row's own adapter's low-rank expand, nonzero blocks only");
  m.def("bf16_pairs", [] { return kPairs; }, "whether bfloat16 B^T blocks are laid out in the rank's pairs");
}
