// Peak arithmetic of this CPU from mha_ext's own peak probes (csrc/cpu/peak_probe.h), the
// roofline that `python -m mha_ext.bench` prints: per probe the CPU and MHA_EXT_CPU_ISA
// allow, GFLOP/s on one thread and on all of at::get_num_threads() (OMP_NUM_THREADS), each the
// fastest of five runs of at least 0.2 s.
//
//   build/cmake/vector_peak           (--smoke: every probe once, briefly, as ctest runs it)
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "cpu/peak_probe.h"

namespace {

// GFLOP/s of the kind on the current thread count: the fastest of `runs` runs of at least
// min_seconds.
double peak_gflops(mha_ext::cpu::PeakProbeKind kind, double min_seconds, int runs) {
  int64_t iterations = 1000;
  mha_ext::cpu::PeakProbeResult run = mha_ext::cpu::run_peak_probe(kind, iterations);
  while (run.slowest_seconds < min_seconds) {
    iterations *= 2;
    run = mha_ext::cpu::run_peak_probe(kind, iterations);
  }
  double best = run.gflops();
  for (int i = 1; i < runs; ++i) {
    best = std::max(best, mha_ext::cpu::run_peak_probe(kind, iterations).gflops());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const bool smoke = argc > 1 && std::strcmp(argv[1], "--smoke") == 0;
  const double min_seconds = smoke ? 0.0 : 0.2;
  const int runs = smoke ? 1 : 5;
  try {
    const int threads = at::get_num_threads();
    const std::string all_threads = std::to_string(threads) + " threads";
    std::printf("%-18s %14s %14s\n", "GFLOP/s", "1 thread", all_threads.c_str());
    for (mha_ext::cpu::PeakProbeKind kind : mha_ext::cpu::available_peak_probes()) {
      at::set_num_threads(1);
      const double one = peak_gflops(kind, min_seconds, runs);
      at::set_num_threads(threads);
      const double all = peak_gflops(kind, min_seconds, runs);
      std::printf("%-18s %14.1f %14.1f\n", mha_ext::cpu::peak_probe_name(kind), one, all);
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "vector_peak: %s\n", error.what());
    return 1;
  }
  return 0;
}
