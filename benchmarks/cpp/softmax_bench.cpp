// The vector work the forward kernels do per score besides their two products: one
// online-softmax step (max, fp32 exp, sum) over a 64-row score tile, in the fp32 kernels'
// form (online_softmax_tile) and in the bf16 forward's (softmax_tile_to_probs, which also
// rounds P to bf16), timed on one core. With the matmul roofline it bounds any kernel that
// keeps the softmax in fp32: a forward of F flops over N scores on T cores takes at least
// F / roofline + N * (ns per score) / T.
//
// online_softmax_tile overwrites the scores with P, and each iteration runs on what the
// last one left: its vector passes take the same time whatever the values (no
// value-dependent branches but the rare rescale; lanes far below the max are zeroed by a
// mask, not a slow path), and refreshing the tile would time a copy too.
// softmax_tile_to_probs leaves the scores as they are.
//
//   build/cmake/softmax_bench            (CPUs with AVX512-BF16 only: the whole program is
//                                         compiled for them; prints ns_per_score)
//   build/cmake/softmax_bench_avx2       (the AVX2 kernels' fp32 step, CPUs with AVX2 + FMA)
#include "bench_common.h"

// The kernels' code for the ISA this program is compiled for (CMake builds this source once
// per ISA, with that ISA's -m flags), in the namespace its kernels_<isa>.cpp compiles it in.
#pragma GCC diagnostic ignored "-Wpsabi"
#if defined(__AVX512F__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#else
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#include "cpu/kernels/kernel_common.h"

#include <cmath>
#include <random>

namespace mha_ext::bench {
namespace {

namespace kernels = cpu::CPU_CAPABILITY;
using cpu::kQueryBlock;

struct ScoreTile {
  int64_t cols, head_dim_v;
  std::vector<float> tile, out, row_max,
      row_sum;  // [kQueryBlock, cols], [kQueryBlock, head_dim_v], [kQueryBlock] x 2

  ScoreTile(int64_t cols_, int64_t head_dim_v_)
      : cols(cols_),
        head_dim_v(head_dim_v_),
        tile(kQueryBlock * cols),
        out(kQueryBlock * head_dim_v, 0.f),
        row_max(kQueryBlock, 0.f),
        row_sum(kQueryBlock, 1.f) {
    // Unscaled scores q.k of unit-variance rows have a standard deviation of sqrt(head dim),
    // 1 after the softmax scale. The running max starts above them (6 in the log2 units of
    // both kernels' maxima, about 4 in natural ones), so the lazy rescale stays as rare as in
    // a long row.
    std::mt19937 generator(0);
    std::normal_distribution<float> score(0.f, std::sqrt(static_cast<float>(head_dim_v)));
    for (float& s : tile) s = score(generator);
    std::fill(row_max.begin(), row_max.end(), 6.f);
  }
};

void count_scores(benchmark::State& state, const ScoreTile& t) {
  state.counters["ns_per_score"] =
      benchmark::Counter(state.iterations() * kQueryBlock * t.cols,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// The fp32 kernels' step, with the scale fused into the exp.
void BM_SoftmaxTileFp32(benchmark::State& state) {
  ScoreTile t(state.range(0), state.range(1));
  const float scale = 1.f / std::sqrt(static_cast<float>(t.head_dim_v));
  for (auto _ : state) {
    kernels::online_softmax_tile(t.tile.data(), t.cols, kQueryBlock, t.cols, t.row_max.data(),
                                 t.row_sum.data(), t.out.data(), t.head_dim_v, t.head_dim_v, scale);
    benchmark::DoNotOptimize(t.tile.data());
    benchmark::ClobberMemory();
  }
  count_scores(state, t);
}

#if defined(CPU_CAPABILITY_AVX512)
// The bf16 forward's step (attention_forward_bf16_brgemm), P rounded to bf16.
void BM_SoftmaxTileBf16(benchmark::State& state) {
  ScoreTile t(state.range(0), state.range(1));
  const float scale = 1.f / std::sqrt(static_cast<float>(t.head_dim_v));
  std::vector<float> row_sums(kQueryBlock * kernels::kSumLanes, 1.f);  // [kQueryBlock, kSumLanes]
  const int64_t ld_probs = kernels::round_up(t.cols, 32);    // as softmax_tile_to_probs writes
  std::vector<c10::BFloat16> probs(kQueryBlock * ld_probs);  // [kQueryBlock, ld_probs]
  for (auto _ : state) {
    kernels::softmax_tile_to_probs(t.tile.data(), t.cols, kQueryBlock, t.cols, scale,
                                   t.row_max.data(), row_sums.data(), t.out.data(), t.head_dim_v,
                                   t.head_dim_v, probs.data(), ld_probs);
    benchmark::DoNotOptimize(probs.data());
    benchmark::ClobberMemory();
  }
  count_scores(state, t);
}
#endif

void register_all(const Options& options) {
  // The kernels' tiles: 64 keys in the fp32 kernels (kKeyBlock) and, from bf16_key_tile, 128
  // keys in the bf16 forward at head dim 64 and 64 at head dim 128.
  struct Case {
    const char* name;
    void (*run)(benchmark::State&);
    std::vector<std::vector<int64_t>> tiles;  // {keys, head_dim_v}
  };
  const std::vector<Case> cases = {
      {"BM_SoftmaxTile/fp32", BM_SoftmaxTileFp32, {{64, 64}, {64, 128}}},
#if defined(CPU_CAPABILITY_AVX512)
      {"BM_SoftmaxTile/bf16", BM_SoftmaxTileBf16, {{128, 64}, {64, 128}}},
#endif
  };
  for (const Case& c : cases) {
    for (const auto& tile : options.smoke ? std::vector<std::vector<int64_t>>{{16, 16}} : c.tiles) {
      auto* bench =
          benchmark::RegisterBenchmark(c.name, c.run)->Args(tile)->ArgNames({"keys", "head_dim_v"});
      if (options.smoke) bench->Iterations(1);
    }
  }
}

}  // namespace
}  // namespace mha_ext::bench

int main(int argc, char** argv) {
  return mha_ext::bench::run(argc, argv, &mha_ext::bench::register_all);
}
