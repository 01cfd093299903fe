// The whole-model graph's linear products as C++ operators, found by the same handles as graph.py's Python ones:
//   batchrun_native::packed_linear(x, handle, out_features, bias): a oneDNN-packed float weight
//     (mkldnn::_linear_pointwise, as cpu_gemm.linear calls it);
//   batchrun_native::rotated_w8a8(x, handle, out_features, block): a W8A8 layer quantized under the Hadamard
//     rotation, its int8 weight packed for onednn::qlinear_pointwise (cpu_kernels.Int8OneDNN): the rows rotated and
//     quantized in one pass (rotate_quant.h), the product, the row scale.
// As Python custom ops, each call spent 15-90 us in Python around its product, and that Python runs cold: the
// product before it has just streamed megabytes of weights through the caches. Here the work between the products
// is a registry lookup and the dispatcher. The weights are registered by native_linear.py (and dropped with their
// layer); rotate_quantize and scale_rows_ are bound for the eager paths too.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "rotate_quant.h"

namespace {

// A registered weight: packed for oneDNN; int8 ones with their per-output-channel scale and zero points.
struct Weight {
  at::Tensor packed, scale, zero_points;
};

std::shared_mutex registry_lock;
std::unordered_map<int64_t, Weight> registry;

void register_weight(int64_t handle, at::Tensor packed, std::optional<at::Tensor> scale,
                     std::optional<at::Tensor> zero_points) {
  std::unique_lock lock(registry_lock);
  registry[handle] = Weight{std::move(packed), scale.value_or(at::Tensor()), zero_points.value_or(at::Tensor())};
}

void release(int64_t handle) {
  std::unique_lock lock(registry_lock);
  registry.erase(handle);
}

Weight find(int64_t handle, bool int8) {
  std::shared_lock lock(registry_lock);
  const auto it = registry.find(handle);
  TORCH_CHECK(it != registry.end(), "batchrun_native: no weight is registered under handle ", handle);
  TORCH_CHECK(it->second.scale.defined() == int8, "batchrun_native: the weight under handle ", handle, " is not ",
              int8 ? "int8" : "a float one");
  return it->second;
}

// oneDNN's ops are called boxed: their C++ signatures are not in public headers, their schemas are.
at::Tensor call(const c10::OperatorHandle& op, torch::jit::Stack stack) {
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor packed_linear(const at::Tensor& x, int64_t handle, int64_t /*out_features*/,
                         const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return call(op, {x, find(handle, false).packed, bias, std::string("none"),
                   c10::List<std::optional<at::Scalar>>(), c10::IValue()});
}

// The codes go in unsigned with zero point 128 (why: cpu_kernels.Int8OneDNN); float16 rows are multiplied into
// float32 and rounded once at the end, as cpu_kernels.product_dtype does.
at::Tensor rotated_w8a8(const at::Tensor& x, int64_t handle, int64_t /*out_features*/, int64_t block) {
  const Weight weight = find(handle, true);
  auto [codes, row_scale] = batchrun::rotate_quantize(x.contiguous(), block, /*flip_sign=*/true);
  const at::ScalarType out_dtype = x.scalar_type() == at::kHalf ? at::kFloat : x.scalar_type();
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  at::Tensor out = call(op, {codes, 1.0, int64_t{128}, weight.packed, weight.scale, weight.zero_points, c10::IValue(), 1.0,
                         int64_t{0}, out_dtype, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                         std::string("")});
  return batchrun::scale_rows_(out, row_scale).to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(batchrun_native, m) {
  m.def("packed_linear(Tensor x, int handle, int out_features, Tensor? bias) -> Tensor");
  m.def("rotated_w8a8(Tensor x, int handle, int out_features, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchrun_native, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("rotated_w8a8", &rotated_w8a8);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_weight", &register_weight, "a packed weight (with its int8 scale and zero points) under a handle");
  m.def("release", &release, "drop the weight under a handle");
  m.def("rotate_quantize", &batchrun::rotate_quantize,
        "rows rotated by block Hadamard matrices and quantized to int8 codes (or uint8 codes + 128)");
  m.def("scale_rows_", &batchrun::scale_rows_, "each row times its float32 scale, in place");
}
