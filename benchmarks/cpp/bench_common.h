#pragma once
// Helpers shared by the C++ microbenchmarks: dtype codes for benchmark arguments, random
// tensors, and the --smoke switch that CI uses to run every benchmark once on a tiny shape.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <sstream>
#include <string>
#include <vector>

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

// The arguments this program adds to Google Benchmark's, removed from argv before
// benchmark::Initialize sees them.
struct Options {
  bool smoke = false;  // --smoke: tiny shapes, one iteration each (CI's ctest run)
  // --shape=1,32,8,2048,128,1,1 (repeatable): run these argument lists instead of the
  // built-in model shapes; the numbers are the benchmark's arguments in order.
  std::vector<std::vector<int64_t>> shapes;
};

inline Options take_options(int* argc, char** argv) {
  Options options;
  int kept = 0;
  for (int i = 0; i < *argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--smoke") {
      options.smoke = true;
    } else if (arg.rfind("--shape=", 0) == 0) {
      std::vector<int64_t> shape;
      std::stringstream values(arg.substr(8));
      for (std::string value; std::getline(values, value, ',');) shape.push_back(std::stoll(value));
      options.shapes.push_back(shape);
    } else {
      argv[kept++] = argv[i];
    }
  }
  *argc = kept;
  return options;
}

// The main of every benchmark program: our options, Google Benchmark's, then the runs that
// register_all adds.
inline int run(int argc, char** argv, void (*register_all)(const Options&)) {
  const Options options = take_options(&argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all(options);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace mha_ext::bench
