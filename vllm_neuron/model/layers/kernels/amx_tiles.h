// What every AMX kernel needs before its first tile instruction (linear_amx.cpp, attention_amx.h).
#pragma once
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

// Linux hands out the tile registers' state only on request (once per process); a kernel asks before it
// configures tiles, and a caller with a vector path takes that path where the answer is no.
inline bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// The LDTILECFG operand (palette 1): per tile, its rows and its bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace amx
