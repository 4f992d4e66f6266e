#pragma once
// Helpers shared by the C++ microbenchmarks: dtype codes for benchmark arguments, random
// tensors, and the --smoke switch that CI uses to run every benchmark once on a tiny shape.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <cstring>
#include <string>

namespace mha_ext::bench {

// Benchmark arguments are integers: 0 = fp32, 1 = bf16, 2 = fp16.
inline at::ScalarType dtype_of(int64_t code) {
  switch (code) {
    case 1: return at::kBFloat16;
    case 2: return at::kHalf;
    default: return at::kFloat;
  }
}

inline std::string dtype_label(int64_t code) {
  return code == 1 ? "bf16" : code == 2 ? "fp16" : "fp32";
}

inline at::Tensor random(at::IntArrayRef shape, int64_t dtype_code) {
  return at::randn(shape).to(dtype_of(dtype_code));
}

// True when --smoke is among the arguments (and removes it, so Google Benchmark does not
// reject it): register tiny shapes and run each benchmark for one iteration.
inline bool take_smoke_flag(int* argc, char** argv) {
  bool smoke = false;
  int kept = 0;
  for (int i = 0; i < *argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0) {
      smoke = true;
    } else {
      argv[kept++] = argv[i];
    }
  }
  *argc = kept;
  return smoke;
}

}  // namespace mha_ext::bench
