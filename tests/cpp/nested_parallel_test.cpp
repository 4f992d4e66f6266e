// The CPU ops called from inside an outer parallel region: an OpenMP team and
// at::parallel_for. Each call must give bitwise what a call from outside gives, finish (no
// deadlock), and start no thread of its own (no oversubscription: its loops run on the
// calling thread, as at::parallel_for does inside a parallel region). Exits 1 on a mismatch
// or a new thread; a deadlock is caught by ctest's timeout.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dirent.h>
#include <omp.h>

#include <array>
#include <cstdio>
#include <optional>
#include <vector>

#include "cpu/backend.h"
#include "ops/attention.h"

namespace {

constexpr int kOuterThreads = 4;

struct Inputs {
  at::Tensor q, k, v;  // (B, H, S, D), (B, Hkv, S, D), (B, Hkv, S, D)
};

Inputs make_inputs(at::ScalarType dtype) {
  at::manual_seed(3);
  return {at::randn({2, 4, 150, 64}).to(dtype), at::randn({2, 2, 150, 64}).to(dtype),
          at::randn({2, 2, 150, 64}).to(dtype)};
}

at::Tensor forward(const Inputs& in) {
  const auto [out, lse] = mha_ext::attention_forward<mha_ext::cpu::Backend>(
      in.q, in.k, in.v, /*attn_mask=*/std::nullopt, /*dropout_seed=*/std::nullopt,
      /*dropout_p=*/0.0, /*scale=*/0.125, /*window_left=*/-1, /*window_right=*/0,
      /*bottom_right=*/true, /*softcap=*/0.0, /*alibi_slopes=*/std::nullopt,
      /*sinks=*/std::nullopt, /*cu_seqlens_q=*/std::nullopt, /*cu_seqlens_k=*/std::nullopt,
      /*seqused_k=*/std::nullopt, /*max_seqlen_q=*/0, /*max_seqlen_k=*/0,
      /*deterministic=*/false);
  return out;
}

// Threads of this process (entries of /proc/self/task besides . and ..).
int process_threads() {
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return -1;
  int entries = 0;
  while (readdir(tasks) != nullptr) ++entries;
  closedir(tasks);
  return entries - 2;
}

// Calls forward kOuterThreads times from the outer region `run_outer` starts and compares
// each result with `expected`.
template <typename RunOuter>
bool check_nested(const char* outer, const Inputs& in, const at::Tensor& expected,
                  const RunOuter& run_outer) {
  std::array<at::Tensor, kOuterThreads> results;
  const int threads_before = process_threads();
  run_outer([&](int index) { results[index] = forward(in); });
  const int threads_after = process_threads();
  bool ok = true;
  for (int index = 0; index < kOuterThreads; ++index) {
    if (!at::equal(results[index], expected)) {
      std::printf("%s, %s: call %d differs from the serial call\n", outer,
                  c10::toString(in.q.scalar_type()), index);
      ok = false;
    }
  }
  if (threads_after != threads_before) {
    std::printf("%s, %s: the process had %d threads before the nested calls, %d after\n", outer,
                c10::toString(in.q.scalar_type()), threads_before, threads_after);
    ok = false;
  }
  return ok;
}

}  // namespace

int main() {
  at::set_num_threads(kOuterThreads);
  // Start both kinds of outer region once, so that their worker threads exist before counting.
  at::parallel_for(0, kOuterThreads, 1, [](int64_t, int64_t) {});
#pragma omp parallel num_threads(kOuterThreads)
  {
  }
  bool ok = true;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const Inputs in = make_inputs(dtype);
    const at::Tensor expected = forward(in);
    ok &= check_nested("OpenMP team", in, expected, [](const auto& call) {
#pragma omp parallel num_threads(kOuterThreads)
      call(omp_get_thread_num());
    });
    ok &= check_nested("at::parallel_for", in, expected, [](const auto& call) {
      at::parallel_for(0, kOuterThreads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t index = begin; index < end; ++index) call(static_cast<int>(index));
      });
    });
  }
  std::printf(ok ? "nested parallel regions: ok\n" : "nested parallel regions: FAILED\n");
  return ok ? 0 : 1;
}
