#pragma once
// LDTILECFG's operand, for the AMX code of the library and of the standalone benchmarks
// (no torch here).
#include <cstdint>

namespace mha_ext::cpu {

// All zero (no configuration, as STTILECFG stores when none is loaded), or palette 1 with all
// 8 tiles of `tile_rows` rows x `tile_row_bytes` bytes.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 0;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t row_bytes[16] = {};
  uint8_t rows[16] = {};

  AmxTileConfig() = default;
  AmxTileConfig(int tile_rows, int tile_row_bytes) : palette(1) {
    for (int tile = 0; tile < 8; ++tile) {
      rows[tile] = static_cast<uint8_t>(tile_rows);
      row_bytes[tile] = static_cast<uint16_t>(tile_row_bytes);
    }
  }
};
static_assert(sizeof(AmxTileConfig) == 64, "LDTILECFG reads 64 bytes");

}  // namespace mha_ext::cpu
