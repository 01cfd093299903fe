// Vector helpers shared by the CPU attention kernels, on ATen's at::vec::Vectorized: one source that compiles to
// AVX-512 or AVX2 by the CPU_CAPABILITY_* macro the loader (cpu_attention.py) defines from the CPU's flags. Without
// that macro ATen's 16-bit and 8-bit conversions fall back to scalar loops.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace batchrun {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// The first n (<= kLanes) elements at p as float32 lanes, the others zero. T: float, BFloat16, Half, int8_t or
// Float8_e4m3fn (8-bit codes come back unscaled: callers apply the row's scale after the dot product).
template <typename T>
inline Vec load_float(const T* p, int64_t n = kLanes) {
  if constexpr (std::is_same_v<T, float>) {
    return n == kLanes ? Vec::loadu(p) : Vec::loadu(p, n);
  } else if constexpr (at::vec::is_reduced_floating_point_v<T>) {
    if (n == kLanes) {
      Vec out;
      at::vec::load_to_float(p, out);
      return out;
    }
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, n)));
  } else {
    return at::vec::convert<float>(at::vec::Vectorized<T>::loadu(p, static_cast<T>(n)));
  }
}

// The first n elements of v to p as T (n <= kLanes).
template <typename T>
inline void store_float(const Vec& v, T* p, int64_t n = kLanes) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, n);
  } else {
    at::vec::convert_from_float<T>(v, Vec(0.f)).store(p, n);
  }
}

inline int64_t padded(int64_t dim) { return (dim + kLanes - 1) / kLanes * kLanes; }

// dim elements of src (any T above) into dst as float32, dst padded with zeros to padded(dim), times `scale`.
template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t dim, float scale = 1.f) {
  for (int64_t d = 0; d < dim; d += kLanes) {
    (load_float(src + d, std::min(kLanes, dim - d)) * Vec(scale)).store(dst + d);
  }
}

// Dot product of two float rows padded to a whole number of lanes (dim = padded length).
inline float dot(const float* a, const float* b, int64_t dim) {
  Vec acc(0.f);
  for (int64_t d = 0; d < dim; d += kLanes) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  return acc.reduce_add();
}

// acc += p * row over a padded float row.
inline void axpy(float p, const float* row, float* acc, int64_t dim) {
  const Vec pv(p);
  for (int64_t d = 0; d < dim; d += kLanes) {
    at::vec::fmadd(pv, Vec::loadu(row + d), Vec::loadu(acc + d)).store(acc + d);
  }
}

// s[0:n] = exp(s - top), returns the sum.
inline float exp_and_sum(float* s, int64_t n, float top) {
  Vec total(0.f);
  const Vec tv(top);
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t m = std::min(kLanes, n - i);
    Vec e = (Vec::loadu(s + i, m) - tv).exp();
    if (m < kLanes) e = Vec::set(Vec(0.f), e, m);   // lanes past n are not part of the sum
    e.store(s + i, m);
    total = total + e;
  }
  return total.reduce_add();
}

inline float max_of(const float* s, int64_t n) {
  Vec top(s[0]);   // n >= 1; partial loads below repeat s[0] in the unused lanes
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t m = std::min(kLanes, n - i);
    top = at::vec::maximum(top, m == kLanes ? Vec::loadu(s + i) : Vec::set(Vec(s[0]), Vec::loadu(s + i, m), m));
  }
  return top.reduce_max();
}

}  // namespace batchrun
