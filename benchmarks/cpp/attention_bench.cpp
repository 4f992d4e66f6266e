// Fused attention forward and backward on the CPU, driven through the params structs with
// no Python: items/s are query rows, FLOP/s counts 4 B H Sq Sk D (halved when causal) for
// the forward and 2.5x that for the backward.
//
//   attention_bench [--smoke] [--shape=B,H,Hkv,S,D,dtype,causal ...] [--benchmark_filter=...]
// Arguments of each run: batch, heads, kv_heads, seq, head_dim, dtype (0 fp32, 1 bf16, 2 fp16),
// causal; e.g. --shape=1,32,8,2048,128,1,1 is Llama-style GQA prefill in bf16, causal.
#include <optional>

#include "bench_common.h"
#include "cpu/backend.h"
#include "ops/attention.h"

namespace mha_ext::bench {
namespace {

struct Problem {
  at::Tensor q, k, v, out, lse;
  AttentionForwardParams params;            // pointing at the tensors above, outputs included
  cpu::Backend::AttentionForwardPlan plan;  // the op's plan: the bf16 forward's workspace
  double forward_flops;
};

Problem make_problem(const benchmark::State& state) {
  const int64_t batch = state.range(0), heads = state.range(1), kv_heads = state.range(2);
  const int64_t seq = state.range(3), head_dim = state.range(4), dtype = state.range(5);
  const bool causal = state.range(6) != 0;
  Problem p;
  p.q = random({batch, heads, seq, head_dim}, dtype);
  p.k = random({batch, kv_heads, seq, head_dim}, dtype);
  p.v = random({batch, kv_heads, seq, head_dim}, dtype);
  p.params = make_attention_params(
      p.q, p.k, p.v, /*attn_mask=*/std::nullopt, /*dropout_seed=*/std::nullopt,
      /*dropout_p=*/0.0, 1.0 / std::sqrt(static_cast<double>(head_dim)), /*window_left=*/-1,
      /*window_right=*/causal ? 0 : -1, /*bottom_right=*/true, /*softcap=*/0.0,
      /*alibi_slopes=*/std::nullopt, /*sinks=*/std::nullopt, /*cu_seqlens_q=*/std::nullopt,
      /*cu_seqlens_k=*/std::nullopt, /*seqused_k=*/std::nullopt, /*max_seqlen_q=*/0,
      /*max_seqlen_k=*/0, cpu::Backend::kIndicesOnHost);
  p.out = at::empty_like(p.q);
  p.lse = at::empty({batch, heads, seq}, at::kFloat);
  set_forward_outputs(p.params, p.out, p.lse);
  p.plan = cpu::Backend::plan(p.params, p.q);
  p.forward_flops = 4.0 * batch * heads * seq * seq * head_dim / (causal ? 2 : 1);
  return p;
}

void set_counters(benchmark::State& state, const Problem& p, double flops) {
  state.SetItemsProcessed(state.iterations() * p.params.batch * p.params.num_heads *
                          p.params.seq_q);
  state.counters["FLOP/s"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(dtype_label(state.range(5)) + (state.range(6) ? " causal" : ""));
}

void attention_forward(benchmark::State& state) {
  Problem p = make_problem(state);
  for (auto _ : state) {
    cpu::Backend::run(p.params, p.plan);
    benchmark::DoNotOptimize(p.out.data_ptr());
  }
  set_counters(state, p, p.forward_flops);
}

void attention_backward(benchmark::State& state) {
  Problem p = make_problem(state);
  cpu::Backend::run(p.params, p.plan);  // the out and lse the backward reads

  AttentionBackwardCall bwd;
  static_cast<AttentionForwardParams&>(bwd.params) = p.params;
  at::Tensor grad_out = random(p.out.sizes(), state.range(5));
  fill_backward_tensors(bwd, grad_out, std::nullopt, p.q, p.k, p.v, p.out, p.lse);
  const cpu::Backend::AttentionBackwardPlan plan = cpu::Backend::plan(bwd.params, p.q);
  for (auto _ : state) {
    cpu::Backend::run(bwd.params, plan);
    benchmark::DoNotOptimize(bwd.grad_q.data_ptr());
  }
  set_counters(state, p, 2.5 * p.forward_flops);
}

void register_all(const Options& options) {
  const bool smoke = options.smoke;
  // batch, heads, kv_heads, seq, head_dim, dtype, causal: GPT-2 small and Llama-2 70B GQA shapes.
  std::vector<std::vector<int64_t>> shapes =
      smoke ? std::vector<std::vector<int64_t>>{{1, 2, 1, 17, 40, 0, 1}, {1, 2, 2, 9, 64, 1, 0}}
            : std::vector<std::vector<int64_t>>{{1, 12, 12, 1024, 64, 0, 0},
                                                {1, 12, 12, 1024, 64, 0, 1},
                                                {1, 12, 12, 1024, 64, 1, 1},
                                                {1, 64, 8, 1024, 128, 0, 1},
                                                {1, 64, 8, 1024, 128, 1, 1}};
  if (!options.shapes.empty()) shapes = options.shapes;
  for (auto [name, function] : {std::pair{"attention_forward", &attention_forward},
                                std::pair{"attention_backward", &attention_backward}}) {
    auto* bench =
        benchmark::RegisterBenchmark(name, function)
            ->ArgNames({"batch", "heads", "kv_heads", "seq", "head_dim", "dtype", "causal"})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
    for (const auto& shape : shapes) bench->Args(shape);
    if (smoke) bench->Iterations(1);
  }
}

}  // namespace
}  // namespace mha_ext::bench

int main(int argc, char** argv) {
  return mha_ext::bench::run(argc, argv, &mha_ext::bench::register_all);
}
