#include "cpu/peak_probe.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "cpu/amx_tile_config.h"
#include "cpu/isa.h"
#include "cpu/parallel.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mha_ext::cpu {
namespace {

constexpr PeakProbeKind kAllKinds[] = {PeakProbeKind::kFp32Portable, PeakProbeKind::kFp32FmaAvx2,
                                       PeakProbeKind::kFp32FmaAvx512, PeakProbeKind::kBf16DotAvx512,
                                       PeakProbeKind::kBf16Amx};

// Each loop returns a value computed from its accumulators, which the caller keeps, so that
// the compiler cannot drop the work. The accumulators converge or grow slowly: no infinities
// and no subnormals, which some units process more slowly.

// 48 floats: 12 SSE registers of accumulators (of x86-64's 16), enough independent
// multiply-add chains to keep the vector ports busy through the 8-cycle latency of a
// multiply followed by an add.
constexpr int kPortableLanes = 48;
// 12 of AVX2's 16 registers, 16 of AVX-512's 32: an FMA has a 4-cycle latency and two ports
// issue one each per cycle on the CPUs that have two FMA units, so 8 chains keep them busy.
constexpr int kAvx2Accumulators = 12;
constexpr int kAvx512Accumulators = 16;
// AMX tiles as the loop configures them: 16 rows of 64 bytes, four of them accumulating.
constexpr int kAmxRows = 16;
constexpr int kAmxRowBytes = 64;
constexpr int kAmxAccumulators = 4;

float fp32_portable_loop(int64_t iterations, float x, float y) {
  // Lanes that start apart: from equal starts the compiler computes one lane and copies it.
  float acc[kPortableLanes];
  for (int lane = 0; lane < kPortableLanes; ++lane) acc[lane] = y * static_cast<float>(lane);
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 48
    for (int lane = 0; lane < kPortableLanes; ++lane) acc[lane] = acc[lane] * x + y;
  }
  float total = 0.0f;
  for (float value : acc) total += value;
  return total;
}

#if defined(__x86_64__)

__attribute__((target("avx2,fma"))) float fp32_fma_avx2_loop(int64_t iterations, float x, float y) {
  __m256 acc[kAvx2Accumulators];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const __m256 xs = _mm256_set1_ps(x), ys = _mm256_set1_ps(y);
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
    for (auto& a : acc) a = _mm256_fmadd_ps(xs, ys, a);
  }
  __m256 total = acc[0];
  for (int j = 1; j < kAvx2Accumulators; ++j) total = _mm256_add_ps(total, acc[j]);
  return _mm256_cvtss_f32(total);
}

__attribute__((target("avx512f"))) float fp32_fma_avx512_loop(int64_t iterations, float x,
                                                              float y) {
  __m512 acc[kAvx512Accumulators];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512 xs = _mm512_set1_ps(x), ys = _mm512_set1_ps(y);
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (auto& a : acc) a = _mm512_fmadd_ps(xs, ys, a);
  }
  __m512 total = acc[0];
  for (int j = 1; j < kAvx512Accumulators; ++j) total = _mm512_add_ps(total, acc[j]);
  return _mm512_cvtss_f32(total);
}

__attribute__((target("avx512f,avx512bf16"))) float bf16_dot_avx512_loop(int64_t iterations,
                                                                         float x, float y) {
  __m512 acc[kAvx512Accumulators];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512bh xs = _mm512_cvtne2ps_pbh(_mm512_set1_ps(x), _mm512_set1_ps(x));
  const __m512bh ys = _mm512_cvtne2ps_pbh(_mm512_set1_ps(y), _mm512_set1_ps(y));
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (auto& a : acc) a = _mm512_dpbf16_ps(a, xs, ys);
  }
  __m512 total = acc[0];
  for (int j = 1; j < kAvx512Accumulators; ++j) total = _mm512_add_ps(total, acc[j]);
  return _mm512_cvtss_f32(total);
}

// AMX: 8 tile registers of up to 16 rows x 64 bytes. Tiles 0-3 accumulate fp32 (16 x 16),
// tiles 4-5 hold A (16 rows x 32 bf16), 6-7 hold B (16 rows of 16 bf16 pairs); each
// TDPBF16PS multiplies one A by one B into its own accumulator, so the four products of an
// iteration are independent and cover the instruction's latency.
// Linux (5.16+) grants a process the AMX tile data state only on request; without it the
// first tile instruction faults. The grant is for the whole process, so one request does.
bool amx_usable() {
  static const bool usable = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return cpu_has_amx_bf16() &&
           syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

__attribute__((target("amx-tile,amx-bf16"))) float bf16_amx_loop(int64_t iterations, float, float) {
  // torch's brgemm keeps its tile configuration loaded between calls on a thread: restore
  // whatever this thread had, so that its next call finds the tiles as it left them.
  AmxTileConfig previous;
  _tile_storeconfig(&previous);
  const AmxTileConfig config(kAmxRows, kAmxRowBytes);
  // GCC's LDTILECFG statement names only 8 bytes of its operand as read: without the barrier
  // the compiler may drop the stores of the rest, and a garbage configuration faults.
  asm volatile("" ::: "memory");
  _tile_loadconfig(&config);
  // bf16 0x3a80 = 2^-10: products of 2^-20, sums that stay far from overflow.
  alignas(64) uint16_t operand[kAmxRows * kAmxRowBytes / 2];
  std::fill(std::begin(operand), std::end(operand), uint16_t{0x3a80});
  asm volatile("" ::: "memory");  // the tile loads' statements do not name memory at all
  _tile_loadd(4, operand, kAmxRowBytes);
  _tile_loadd(5, operand, kAmxRowBytes);
  _tile_loadd(6, operand, kAmxRowBytes);
  _tile_loadd(7, operand, kAmxRowBytes);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < iterations; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float result[kAmxRows * kAmxRowBytes / 4];
  float total = 0.0f;
  _tile_stored(0, result, kAmxRowBytes);
  total += result[0];
  _tile_stored(3, result, kAmxRowBytes);
  total += result[0];
  if (previous.palette != 0) {
    _tile_loadconfig(&previous);
  } else {
    _tile_release();
  }
  return total;
}
#endif

using ProbeLoop = float (*)(int64_t iterations, float x, float y);

ProbeLoop probe_loop(PeakProbeKind kind) {
  switch (kind) {
    case PeakProbeKind::kFp32Portable: return fp32_portable_loop;
#if defined(__x86_64__)
    case PeakProbeKind::kFp32FmaAvx2: return fp32_fma_avx2_loop;
    case PeakProbeKind::kFp32FmaAvx512: return fp32_fma_avx512_loop;
    case PeakProbeKind::kBf16DotAvx512: return bf16_dot_avx512_loop;
    case PeakProbeKind::kBf16Amx: return bf16_amx_loop;
#else
    default: break;
#endif
  }
  throw std::invalid_argument(std::string("mha_ext: peak probe ") + peak_probe_name(kind) +
                              " is not compiled for this CPU architecture");
}

std::string names_of(const std::vector<PeakProbeKind>& kinds) {
  std::string names;
  for (PeakProbeKind kind : kinds)
    names += (names.empty() ? "" : ", ") + std::string(peak_probe_name(kind));
  return names;
}

}  // namespace

const char* peak_probe_name(PeakProbeKind kind) {
  switch (kind) {
    case PeakProbeKind::kFp32Portable: return "fp32_portable";
    case PeakProbeKind::kFp32FmaAvx2: return "fp32_fma_avx2";
    case PeakProbeKind::kFp32FmaAvx512: return "fp32_fma_avx512";
    case PeakProbeKind::kBf16DotAvx512: return "bf16_dot_avx512";
    case PeakProbeKind::kBf16Amx: return "bf16_amx";
  }
  return "unknown";
}

PeakProbeKind peak_probe_kind(const std::string& name) {
  for (PeakProbeKind kind : kAllKinds) {
    if (name == peak_probe_name(kind)) return kind;
  }
  throw std::invalid_argument("mha_ext: unknown peak probe '" + name + "'; known: " +
                              names_of({std::begin(kAllKinds), std::end(kAllKinds)}));
}

std::vector<PeakProbeKind> available_peak_probes() {
  std::vector<PeakProbeKind> kinds = {PeakProbeKind::kFp32Portable};
#if defined(__x86_64__)
  const CpuIsa isa = active_cpu_isa();
  if (isa >= CpuIsa::kAvx2) kinds.push_back(PeakProbeKind::kFp32FmaAvx2);
  if (isa >= CpuIsa::kAvx512) kinds.push_back(PeakProbeKind::kFp32FmaAvx512);
  if (isa >= CpuIsa::kAvx512Bf16) {
    kinds.push_back(PeakProbeKind::kBf16DotAvx512);
    if (amx_usable()) kinds.push_back(PeakProbeKind::kBf16Amx);
  }
#endif
  return kinds;
}

double peak_probe_flops_per_iteration(PeakProbeKind kind) {
  constexpr int kFp32PerAvx2 = 8, kFp32PerAvx512 = 16;
  switch (kind) {
    case PeakProbeKind::kFp32Portable: return 2.0 * kPortableLanes;
    case PeakProbeKind::kFp32FmaAvx2: return 2.0 * kFp32PerAvx2 * kAvx2Accumulators;
    case PeakProbeKind::kFp32FmaAvx512: return 2.0 * kFp32PerAvx512 * kAvx512Accumulators;
    // Each fp32 lane adds two bf16 products: 4 FLOPs.
    case PeakProbeKind::kBf16DotAvx512: return 4.0 * kFp32PerAvx512 * kAvx512Accumulators;
    // Per TDPBF16PS: 16 x 16 fp32 outputs, each adding 32 bf16 products.
    case PeakProbeKind::kBf16Amx: {
      constexpr int outputs = kAmxRows * (kAmxRowBytes / 4), products = kAmxRowBytes / 2;
      return 2.0 * outputs * products * kAmxAccumulators;
    }
  }
  return 0.0;
}

PeakProbeResult run_peak_probe(PeakProbeKind kind, int64_t iterations) {
  if (iterations < 1) {
    throw std::invalid_argument("mha_ext: a peak probe's iterations must be at least 1, got " +
                                std::to_string(iterations));
  }
  const std::vector<PeakProbeKind> available = available_peak_probes();
  if (std::find(available.begin(), available.end(), kind) == available.end()) {
    throw std::invalid_argument(std::string("mha_ext: peak probe ") + peak_probe_name(kind) +
                                " cannot run here (CPU ISA " + cpu_isa_name(active_cpu_isa()) +
                                "); available: " + names_of(available));
  }
  const ProbeLoop loop = probe_loop(kind);
  const int64_t threads = at::get_num_threads();
  // Indexed by the first loop of a chunk: one slot per chunk, whichever thread runs it.
  std::vector<double> chunk_seconds(threads, 0.0);
  std::vector<float> sinks(threads, 0.0f);
  // x and y read from memory the compiler cannot see through, so it cannot fold the loops.
  volatile float x = 0.999f, y = 1e-3f;
  const float x_value = x, y_value = y;
  // A chunk is timed as a whole: a thread given two loops (a smaller team than asked for, or
  // the serial path after fork) takes twice as long, and the rate stays true.
  parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    const auto start = std::chrono::steady_clock::now();
    float sink = 0.0f;
    for (int64_t t = begin; t < end; ++t) sink += loop(iterations, x_value, y_value);
    chunk_seconds[begin] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    sinks[begin] = sink;
  });
  volatile float kept = 0.0f;
  for (float sink : sinks) kept = kept + sink;
  PeakProbeResult result;
  result.threads = threads;
  result.iterations = iterations;
  result.slowest_seconds = *std::max_element(chunk_seconds.begin(), chunk_seconds.end());
  result.flops = peak_probe_flops_per_iteration(kind) * static_cast<double>(iterations) *
                 static_cast<double>(threads);
  return result;
}

}  // namespace mha_ext::cpu
