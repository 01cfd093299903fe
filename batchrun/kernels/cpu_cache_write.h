// The step's new K/V rows into their slots of the paged pool, for a cache that stores them as computed (same
// dtype, no scales): one call for K and V where the torch path took a check for skipped slots, two conversions and
// two index_copy_ calls, each paid again every layer (SmolLM2 bf16, 32 requests: 73 us a layer in a step, where
// the cache writes are cold; this copy moves 2 x 32 rows of 384 bytes).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

namespace batchrun {

// key/value [T, kv_heads, head_dim] (each token's heads contiguous; tokens any stride apart) to slot
// slot_mapping[t] (block * block_size + offset) of k_cache/v_cache [N, block_size, kv_heads, head_dim]; slot -1
// skips a padding row.
inline void write_kv_rows(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                          const torch::Tensor& slot_mapping) {
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type() &&
                  key.scalar_type() == value.scalar_type(), "key, value and cache: one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache/v_cache: contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache/v_cache: one shape");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == k_cache.size(2) &&
                  key.size(2) == k_cache.size(3), "key/value: [tokens, kv_heads, head_dim] of the cache's heads");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0), "slot_mapping: int64, one slot per token");
  // each token's heads as one run of bytes (the split of a fused QKV product gives that; anything else is copied)
  if (key.stride(2) != 1 || key.stride(1) != key.size(2)) key = key.contiguous();
  if (value.stride(2) != 1 || value.stride(1) != value.size(2)) value = value.contiguous();
  const int64_t tokens = key.size(0), slots = k_cache.size(0) * k_cache.size(1);
  const int64_t bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= -1 && slot[t] < slots, "slot_mapping[", t, "] = ", slot[t], ": outside the pool's ",
                slots, " slots");
  }
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_ld = key.stride(0) * key.element_size(), v_ld = value.stride(0) * value.element_size();
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {   // a decode step's rows: one thread
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;
      std::memcpy(k_dst + slot[t] * bytes, k_src + t * k_ld, bytes);
      std::memcpy(v_dst + slot[t] * bytes, v_src + t * v_ld, bytes);
    }
  });
}

}  // namespace batchrun
