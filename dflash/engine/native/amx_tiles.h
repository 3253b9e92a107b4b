// The AMX tile configuration both tile users load (quantized_linear.cpp, causal_attention.cpp):
// palette 1, each tile's rows and bytes per row.
#pragma once

#include <immintrin.h>

#include <cstdint>

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void shape(int tile, int tile_rows, int bytes_per_row) {
    rows[tile] = uint8_t(tile_rows);
    colsb[tile] = uint16_t(bytes_per_row);
  }
};

__attribute__((target("amx-tile"))) inline void load_tiles(const TileConfig& config) {
  // gcc's _tile_loadconfig tells the compiler it reads 8 bytes of the config, so without this
  // barrier the stores of the row counts may be dropped (and the first tile instruction faults).
  asm volatile("" ::: "memory");
  _tile_loadconfig(&config);
}

// Not inlined, so code compiled without AMX targets (the bf16 attention paths) may call it.
__attribute__((target("amx-tile"), noinline)) inline void release_tiles() { _tile_release(); }
