// What every AMX kernel needs: whether this build has AMX-BF16 and AMX-INT8 (kAmx, and BATCHRUN_AMX_BUILD for #if), the
// process's permission to use the tile registers (amx_ready) and the tile configuration record (TileConfig).
// Included by cpu_attention_amx.h and amx_linear.cpp.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace batchrun {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(CPU_CAPABILITY_AVX512) && \
    defined(__AVX512BF16__)
#define BATCHRUN_AMX_BUILD 1
constexpr bool kAmx = true;

// Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), once per
// process. BATCHRUN_CPU_AMX=0 keeps the other paths (for A/B measurement).
inline bool amx_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("BATCHRUN_CPU_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ready;
}

// Palette 1: per tile register its rows and bytes a row (load() configures the tiles; that zeroes every tile).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int rows_, int bytes) { rows[tile] = rows_, colsb[tile] = bytes; }
  // Not GCC 12's _tile_loadconfig: its asm names only the record's first 8 bytes as read, so the stores of the
  // bytes a row could be dropped as dead, and were (ldtilecfg then faulted on rows without bytes).
  void load() const { asm volatile("ldtilecfg %0" : : "m"(*this)); }
};
#else
#define BATCHRUN_AMX_BUILD 0
constexpr bool kAmx = false;
inline bool amx_ready() { return false; }
#endif

}  // namespace batchrun
