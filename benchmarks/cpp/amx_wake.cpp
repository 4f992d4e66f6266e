// What one AMX tile product costs after a stretch of vector work, against the vector work
// alone: on a CPU that powers its AMX unit down when idle, the product pays the wake-up. A
// kernel that runs a few tile products per work item between longer vector passes (the
// paged decode's scores) pays it every time. One thread, a tile configuration of 16 rows x 64
// bytes; each product loads two tiles from L1, runs TDPBSSD and stores the result. A second
// table keeps the unit awake through the vector work: one TDPBSSD on tiles loaded once
// (no loads, no store) every `keep-awake` FMA steps, and then the same product as above.
//
//   build/cmake/amx_wake        (x86-64; prints a line and exits 0 without AMX-INT8;
//                                --smoke: a few rounds, as ctest runs it)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "cpu/amx_tile_config.h"

namespace {

alignas(64) int8_t a_tile[16 * 64];
alignas(64) int8_t b_tile[16 * 64];
alignas(64) int32_t c_tile[16 * 16];

bool amx_int8_granted() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_tile = (edx >> 24) & 1, amx_int8 = (edx >> 25) & 1;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return amx_tile && amx_int8 &&
         syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Nanoseconds per round of `steps` steps of 8 independent FMA chains (a step is 8 FMAs),
// followed by one tile product where `with_tiles`; with keep_awake_steps > 0, a product of
// tiles 4 and 5 into tile 6 after every keep_awake_steps steps.
__attribute__((target("avx512f,amx-tile,amx-int8"))) double round_ns(int steps, int rounds,
                                                                     bool with_tiles,
                                                                     int keep_awake_steps = 0) {
  __m512 acc[8];
  for (__m512& a : acc) a = _mm512_set1_ps(1.f);
  const __m512 x = _mm512_set1_ps(0.999f);
  asm volatile("" ::: "memory");
  _tile_loadd(4, a_tile, 64);
  _tile_loadd(5, b_tile, 64);
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < rounds; ++r) {
    for (int s = 0; s < steps; ++s) {
      for (__m512& a : acc) a = _mm512_fmadd_ps(a, x, x);
      if (keep_awake_steps > 0 && s % keep_awake_steps == keep_awake_steps - 1) {
        _tile_dpbssd(6, 4, 5);
      }
    }
    if (with_tiles) {
      asm volatile("" ::: "memory");  // the tile loads' statements name no memory
      _tile_zero(3);
      _tile_loadd(0, a_tile, 64);
      _tile_loadd(1, b_tile, 64);
      _tile_dpbssd(3, 0, 1);
      _tile_stored(3, c_tile, 64);
    }
  }
  const auto end = std::chrono::steady_clock::now();
  alignas(64) float lanes[16];
  __m512 sum = acc[0];
  for (int i = 1; i < 8; ++i) sum = _mm512_add_ps(sum, acc[i]);
  _mm512_store_ps(lanes, sum);
  if (lanes[0] == 0.f) std::printf(" ");  // keeps the chains' results live
  return std::chrono::duration<double, std::nano>(end - start).count() / rounds;
}

__attribute__((target("amx-tile"))) void configure_tiles() {
  const mha_ext::cpu::AmxTileConfig config(16, 64);
  asm volatile("" ::: "memory");  // LDTILECFG's statement names 8 bytes of its operand
  _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

}  // namespace

int main(int argc, char** argv) {
  const bool smoke = argc > 1 && std::strcmp(argv[1], "--smoke") == 0;
  if (!amx_int8_granted()) {
    std::printf("amx_wake: this CPU or kernel gives no AMX-INT8 tiles\n");
    return 0;
  }
  configure_tiles();
  const int rounds = smoke ? 10 : 20000;
  std::printf("%12s %14s %16s %12s\n", "FMA steps", "vector ns", "+ tile product", "difference");
  for (int steps : {10, 25, 50, 100, 200, 400, 1000}) {
    // Each figure is the lower of two runs, alternating, so that a noisy neighbour hits both.
    double vector = 1e30, tiles = 1e30;
    for (int run = 0; run < 2; ++run) {
      vector = std::min(vector, round_ns(steps, rounds, false));
      tiles = std::min(tiles, round_ns(steps, rounds, true));
    }
    std::printf("%12d %14.1f %16.1f %12.1f\n", steps, vector, tiles, tiles - vector);
  }
  constexpr int kSteps = 400;
  std::printf("\n%d FMA steps, kept awake:\n%12s %14s %16s %12s\n", kSteps, "keep-awake",
              "vector ns", "+ tile product", "difference");
  for (int keep_awake_steps : {25, 50, 100, 200}) {
    double vector = 1e30, tiles = 1e30;
    for (int run = 0; run < 2; ++run) {
      vector = std::min(vector, round_ns(kSteps, rounds, false, keep_awake_steps));
      tiles = std::min(tiles, round_ns(kSteps, rounds, true, keep_awake_steps));
    }
    std::printf("%12d %14.1f %16.1f %12.1f\n", keep_awake_steps, vector, tiles, tiles - vector);
  }
  release_tiles();
  return 0;
}
