// LoRA's expand on the CPU: out = y + each row's own adapter's h @ B^T, reading only that adapter's B and only its
// nonzero blocks (the parts of a fused q/k/v or gate/up projection), no per-row mask. Built by lora_expand.py.
//
// y [T, out] and h [T, C] may be row-strided views (of the fused base-and-shrink product); out is a new contiguous
// [T, out] tensor. A piece is one PEFT module of one adapter: its output columns [o0, o1), its first column c0 in h,
// its rank r and the offset of its B^T ([r, o1 - o0], row-major, scaling folded in) in the flat `bt`. Adapter
// position p owns pieces first[p] .. first[p + 1] - 1; runs [R, 3] = (first row, end row, adapter position).
// Accumulates in float32 from y's value and rounds once, as oneDNN's product with an added operand does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_vec.h"

namespace {

using batchrun::kLanes;
using batchrun::load_float;
using batchrun::store_float;
using batchrun::Vec;

constexpr int64_t kVecs = 4;                    // independent accumulators per row: FMA latency hidden
constexpr int64_t kBlock = kVecs * kLanes;      // output columns one task works on

// out[t, o0 + col .. + kBlock) += h_t @ B^T block, for rows [start, end): the block of B^T (r x kBlock) converted
// to float32 once and read from L1 for every row, h's rows already in float32 (hf: rows x r).
template <typename T>
void expand_block(const float* hf, const T* b, int64_t n, int64_t r, int64_t col, int64_t start, int64_t end, T* out,
                  int64_t width, float* bf) {
  const int64_t lanes = std::min(kBlock, n - col);
  for (int64_t j = 0; j < r; ++j) {
    for (int64_t k = 0; k < kVecs; ++k) {
      const int64_t m = std::max<int64_t>(0, std::min(kLanes, lanes - k * kLanes));
      (m ? load_float(b + j * n + col + k * kLanes, m) : Vec(0.f)).store(bf + j * kBlock + k * kLanes);
    }
  }
  for (int64_t t = start; t < end; ++t) {
    T* dst = out + t * width + col;
    const float* ht = hf + (t - start) * r;
    Vec acc[kVecs];
    for (int64_t k = 0; k < kVecs; ++k) {
      const int64_t m = std::max<int64_t>(0, std::min(kLanes, lanes - k * kLanes));
      acc[k] = m ? load_float(dst + k * kLanes, m) : Vec(0.f);
    }
    for (int64_t j = 0; j < r; ++j) {
      const Vec hj(ht[j]);
      for (int64_t k = 0; k < kVecs; ++k) acc[k] = at::vec::fmadd(hj, Vec::loadu(bf + j * kBlock + k * kLanes), acc[k]);
    }
    for (int64_t k = 0; k < kVecs; ++k) {
      const int64_t m = std::max<int64_t>(0, std::min(kLanes, lanes - k * kLanes));
      if (m) store_float(acc[k], dst + k * kLanes, m);
    }
  }
}

template <typename T>
void expand(const T* y, int64_t y_stride, const T* h, int64_t h_stride, const T* bt, const int64_t* pieces,
            const int64_t* first, const int64_t* runs, int64_t num_runs, T* out, int64_t rows, int64_t width) {
  // Rows outside every run and columns no piece covers keep y's value.
  for (int64_t t = 0; t < rows; ++t) std::copy(y + t * y_stride, y + t * y_stride + width, out + t * width);
  std::vector<float> hf;
  for (int64_t run = 0; run < num_runs; ++run) {
    const int64_t start = runs[3 * run], end = runs[3 * run + 1], p = runs[3 * run + 2];
    for (int64_t piece = first[p]; piece < first[p + 1]; ++piece) {
      const int64_t* q = pieces + 5 * piece;
      const int64_t o0 = q[0], n = q[1] - q[0], c0 = q[2], r = q[3];
      hf.resize((end - start) * r);
      for (int64_t t = start; t < end; ++t)
        for (int64_t j = 0; j < r; ++j) hf[(t - start) * r + j] = static_cast<float>(h[t * h_stride + c0 + j]);
      at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t stop) {
        std::vector<float> bf(r * kBlock);
        for (int64_t block = begin; block < stop; ++block)
          expand_block(hf.data(), bt + q[4], n, r, block * kBlock, start, end, out + o0, width, bf.data());
      });
    }
  }
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
}
