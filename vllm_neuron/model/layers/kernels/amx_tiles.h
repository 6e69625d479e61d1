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

// The config of VN_AMX_ROW_TILES' layout for `rows` input rows (1..64): C tiles 0..3 of 16 rows (the last
// partial) x 16 four-byte sums, A tiles 4, 7 (16 rows) and 5 (the last tile's rows) of `a_bytes` per row, and the
// B tile 6 of `b_rows` x 64 bytes.
inline TileConfig row_tiles_config(int64_t rows, int a_bytes, int b_rows) {
  TileConfig c;
  const int64_t mt = (rows + 15) / 16, last = rows - 16 * (mt - 1);
  for (int64_t i = 0; i < mt; ++i) {
    c.rows[i] = static_cast<uint8_t>(i == mt - 1 ? last : 16);
    c.colsb[i] = 64;
  }
  c.rows[4] = c.rows[7] = 16;
  c.rows[5] = static_cast<uint8_t>(last);
  c.colsb[4] = c.colsb[5] = c.colsb[7] = static_cast<uint16_t>(a_bytes);
  c.rows[6] = static_cast<uint8_t>(b_rows);
  c.colsb[6] = 64;
  return c;
}

}  // namespace amx

// OP(C, A) for each C tile of 16 input rows (0..MT-1) and the A tile that loads its rows. Tile numbers must be
// literals (GCC's intrinsics paste them into the instruction's text), hence a macro handed a macro. Full A tiles
// alternate between 4 and 7 so that a load need not wait for the product before it; the last (maybe partial) is
// 5; row_tiles_config gives tile 6 to the B tile.
#define VN_AMX_ROW_TILES(MT, OP)   \
  do {                             \
    if constexpr ((MT) == 1) {     \
      OP(0, 5);                    \
    } else if constexpr ((MT) == 2) { \
      OP(0, 4);                    \
      OP(1, 5);                    \
    } else if constexpr ((MT) == 3) { \
      OP(0, 4);                    \
      OP(1, 7);                    \
      OP(2, 5);                    \
    } else {                       \
      OP(0, 4);                    \
      OP(1, 7);                    \
      OP(2, 4);                    \
      OP(3, 5);                    \
    }                              \
  } while (0)
