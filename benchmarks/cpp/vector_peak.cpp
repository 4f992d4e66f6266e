// Peak arithmetic of one core for the two AVX-512 instructions a CPU attention kernel can
// build bf16 products on: VFMADD231PS (fp32 FMA, what mha_ext's kernels use after widening
// bf16 to fp32) and VDPBF16PS (AVX512-BF16 dot product of bf16 pairs into fp32). Each loop
// keeps 16 independent accumulators in registers, so throughput, not latency, bounds it.
// FLOPs count 2 per multiply-add: 32 per FMA, 64 per dot-product instruction.
//
//   build/cmake/vector_peak            (prints GFLOP/s per core; exits 0 without AVX512-BF16)
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

constexpr long kIterations = 100'000'000;
constexpr int kAccumulators = 16;

template <typename Body>
double gflops(double flops_per_iteration, Body&& body) {
  const auto start = std::chrono::steady_clock::now();
  const float sink = body();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (sink == 1.0f) std::puts("");  // keeps the result alive
  return flops_per_iteration * kIterations / seconds / 1e9;
}

__attribute__((target("avx512f"))) float fma_loop() {
  __m512 acc[kAccumulators];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  for (long i = 0; i < kIterations; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm512_fmadd_ps(x, y, acc[j]);
  }
  float total = 0;
  for (auto& a : acc) total += _mm512_reduce_add_ps(a);
  return total;
}

__attribute__((target("avx512f,avx512bf16"))) float dot_loop() {
  __m512 acc[kAccumulators];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // bf16 pairs (1, 1)
  for (long i = 0; i < kIterations; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], x, x);
  }
  float total = 0;
  for (auto& a : acc) total += _mm512_reduce_add_ps(a);
  return total;
}

}  // namespace

int main() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) {
    std::puts("vector_peak: no AVX-512 on this CPU");
    return 0;
  }
  const double fma = gflops(32.0 * kAccumulators, fma_loop);
  std::printf("one core: VFMADD231PS (fp32 FMA)     %7.1f GFLOP/s\n", fma);
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::puts("one core: VDPBF16PS: no AVX512-BF16 on this CPU");
    return 0;
  }
  const double dot = gflops(64.0 * kAccumulators, dot_loop);
  std::printf("one core: VDPBF16PS (bf16 dot, fp32) %7.1f GFLOP/s = %.2fx the fp32 FMA\n", dot,
              dot / fma);
  return 0;
}
