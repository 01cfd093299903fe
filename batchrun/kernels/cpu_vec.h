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

// Prefetch into L2 (no wait) `rows` cache rows from `slot`: `bytes` bytes from element `offset` of each row, in
// both K and V (the AMX path's and the vector path's burst; its bfloat16 dot path prefetches a row at a time between
// its reads, bf16_dots / bf16_pair_rows). A request's
// blocks lie anywhere in the pool, so the hardware prefetcher cannot run ahead across them; issued one step ahead,
// this cut a cold bfloat16 layer's decode attention by 9 % on an Intel Xeon.
template <typename T>
inline void prefetch_rows(const T* k, const T* v, int64_t slot, int64_t rows, int64_t token_stride, int64_t offset,
                          int64_t bytes) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* k_row = reinterpret_cast<const char*>(k + (slot + r) * token_stride + offset);
    const char* v_row = reinterpret_cast<const char*>(v + (slot + r) * token_stride + offset);
    for (int64_t byte = 0; byte < bytes; byte += 64) {
      __builtin_prefetch(k_row + byte, 0, 2);   // read, into L2 (T1)
      __builtin_prefetch(v_row + byte, 0, 2);
    }
  }
}

inline int64_t padded(int64_t dim) { return (dim + kLanes - 1) / kLanes * kLanes; }

// dim elements of src (any T above) into dst as float32, dst padded with zeros to padded(dim), times `scale`.
template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t dim, float scale = 1.f) {
  for (int64_t d = 0; d < dim; d += kLanes) {
    const Vec row = load_float(src + d, std::min(kLanes, dim - d));
    (scale == 1.f ? row : row * Vec(scale)).store(dst + d);
  }
}

// acc += p * row over a padded float row.
inline void axpy(float p, const float* row, float* acc, int64_t dim) {
  const Vec pv(p);
  for (int64_t d = 0; d < dim; d += kLanes) {
    at::vec::fmadd(pv, Vec::loadu(row + d), Vec::loadu(acc + d)).store(acc + d);
  }
}

// Lane r of the result: the sum of all lanes of part[r], for r < kLanes (part is overwritten). A tree of
// deinterleaves (log2(kLanes) levels, kLanes - 1 in all) where a horizontal sum per vector would take one
// reduction each.
inline Vec sum_each(Vec* part) {
  for (int64_t n = kLanes; n > 1; n /= 2) {
    for (int64_t i = 0; i < n / 2; ++i) {
      const auto halves = at::vec::deinterleave2(part[2 * i], part[2 * i + 1]);
      part[i] = halves.first + halves.second;
    }
  }
  return part[0];
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool kBf16Dots = true;
// part[r] for r < n: 16 float32 lanes whose sum is q . k_r, for bfloat16 rows of DIM (a multiple of 32) elements
// at k + r * ld; part[r] = 0 for n <= r < kLanes. AVX512-BF16's dot instruction multiplies the 16-bit values
// pairwise into float32 sums, with no conversion pass.
template <int DIM>
inline void bf16_dots(const at::BFloat16* q, const at::BFloat16* k, int64_t ld, int64_t n, Vec* part,
                      const at::BFloat16* prefetch = nullptr) {
  static_assert(DIM % 32 == 0);
  constexpr int kWords = DIM / 32;
  __m512bh qv[kWords];
  for (int c = 0; c < kWords; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  for (int64_t r = 0; r < kLanes; ++r) {
    if (prefetch != nullptr) {
      for (int c = 0; c < kWords; ++c) __builtin_prefetch(prefetch + r * ld + 32 * c, 0, 2);
    }
    __m512 sum = _mm512_setzero_ps();
    if (r < n) {
      for (int c = 0; c < kWords; ++c) sum = _mm512_dpbf16_ps(sum, qv[c], (__m512bh)_mm512_loadu_si512(k + r * ld + 32 * c));
    }
    part[r] = Vec(sum);
  }
}

// The value rows of kLanes positions (n of them real, the rest zero) as pairs of consecutive positions interleaved
// per element, the operand layout of the dot instruction: pairs[(r / 2) * DIM / 16 + j] for positions r, r + 1.
// Within a vector the elements come in unpack order; bf16_slot maps them back (bf16_accumulate's output).
template <int DIM>
inline void bf16_pair_rows(const at::BFloat16* v, int64_t ld, int64_t n, __m512i* pairs,
                           const at::BFloat16* prefetch = nullptr) {
  constexpr int kWords = DIM / 32;
  for (int64_t r = 0; r < kLanes; r += 2) {
    for (int c = 0; prefetch != nullptr && c < kWords; ++c) {
      __builtin_prefetch(prefetch + r * ld + 32 * c, 0, 2);
      __builtin_prefetch(prefetch + (r + 1) * ld + 32 * c, 0, 2);
    }
    for (int c = 0; c < kWords; ++c) {
      const __m512i a = r < n ? _mm512_loadu_si512(v + r * ld + 32 * c) : _mm512_setzero_si512();
      const __m512i b = r + 1 < n ? _mm512_loadu_si512(v + (r + 1) * ld + 32 * c) : _mm512_setzero_si512();
      pairs[(r / 2) * 2 * kWords + 2 * c] = _mm512_unpacklo_epi16(a, b);
      pairs[(r / 2) * 2 * kWords + 2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
  }
}

// acc (DIM floats in bf16_slot order) += sum over the kLanes positions of p[r] * v_r, p rounded to bfloat16.
template <int DIM>
inline void bf16_accumulate(const Vec& p, const __m512i* pairs, float* acc) {
  constexpr int kVecs = DIM / 16;
  alignas(64) uint32_t weights[kLanes / 2];   // p as bfloat16 pairs, one pair per two positions
  _mm256_store_si256(reinterpret_cast<__m256i*>(weights), (__m256i)_mm512_cvtneps_pbh(__m512(p)));
  __m512 reg[kVecs];
  for (int j = 0; j < kVecs; ++j) reg[j] = _mm512_loadu_ps(acc + 16 * j);
  for (int64_t pair = 0; pair < kLanes / 2; ++pair) {
    const __m512bh w = (__m512bh)_mm512_set1_epi32(weights[pair]);
    for (int j = 0; j < kVecs; ++j) reg[j] = _mm512_dpbf16_ps(reg[j], w, (__m512bh)pairs[pair * kVecs + j]);
  }
  for (int j = 0; j < kVecs; ++j) _mm512_storeu_ps(acc + 16 * j, reg[j]);
}

// The element of the row that bf16_accumulate keeps at acc[i]: unpack interleaves 4-element groups per 128 bits.
inline int64_t bf16_slot(int64_t i) {
  const int64_t word = i / 32, half = i / 16 % 2, lane = i % 16 / 4, j = i % 4;
  return 32 * word + 8 * lane + 4 * half + j;
}
#else
constexpr bool kBf16Dots = false;
template <int DIM>
inline void bf16_dots(const at::BFloat16*, const at::BFloat16*, int64_t, int64_t, Vec*) {}
template <int DIM>
inline void bf16_pair_rows(const at::BFloat16*, int64_t, int64_t, void*) {}
template <int DIM>
inline void bf16_accumulate(const Vec&, const void*, float*) {}
inline int64_t bf16_slot(int64_t i) { return i; }
#endif

}  // namespace batchrun
