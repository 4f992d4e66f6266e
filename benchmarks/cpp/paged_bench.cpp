// Paged KV cache kernels on the CPU, driven through the params structs with no Python:
// decode attention (one query per sequence; bytes/s counts the K/V read) and append (one
// token per call; bytes/s counts the K/V written).
//
//   paged_bench [--smoke] [--shape=... ...] [--benchmark_filter=...]
// paged_decode arguments: batch, heads, kv_heads, context, head_dim, dtype (0 fp32, 1 bf16, 2 fp16), block_size.
// paged_append arguments: context, kv_heads, head_dim, dtype, block_size.
// --shape=... with 7 numbers adds a paged_decode run, with 5 a paged_append run, instead of
// the built-in argument lists.
#include <numeric>

#include "bench_common.h"
#include "cpu/kernels/kernels.h"
#include "paged_checks.h"

namespace mha_ext::bench {
namespace {

void paged_decode(benchmark::State& state) {
  const int64_t batch = state.range(0), heads = state.range(1), kv_heads = state.range(2);
  const int64_t context = state.range(3), head_dim = state.range(4), dtype = state.range(5);
  const int64_t block_size = state.range(6);
  const int64_t blocks_per_seq = (context + block_size - 1) / block_size;
  at::Tensor k_cache = random({batch * blocks_per_seq, kv_heads, block_size, head_dim}, dtype);
  at::Tensor v_cache = random({batch * blocks_per_seq, kv_heads, block_size, head_dim}, dtype);
  // Sequence b owns blocks b, b + batch, b + 2 batch, ...: scattered, as after real use.
  at::Tensor tables = at::arange(batch * blocks_per_seq, at::kInt).view({blocks_per_seq, batch}).t().contiguous();
  at::Tensor seq_lens = at::full({batch}, context, at::kInt);
  at::Tensor cu_seqlens = at::arange(batch + 1, at::kInt);
  at::Tensor q = random({batch, heads, head_dim}, dtype);
  PagedAttentionParams params = make_paged_attention_params(
      q, k_cache, v_cache, tables, seq_lens, cu_seqlens, 1.0 / std::sqrt(static_cast<double>(head_dim)));
  check_paged_index_values(params);
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({batch, heads}, at::kFloat);
  params.out = out.data_ptr();
  params.out_strides = {out.stride(0), out.stride(1)};
  params.lse = lse.data_ptr();
  for (auto _ : state) {
    MHA_EXT_RUN_CPU_KERNEL(paged_attention, params);
    benchmark::DoNotOptimize(out.data_ptr());
  }
  const int64_t kv_bytes = 2 * batch * kv_heads * context * head_dim * static_cast<int64_t>(q.element_size());
  state.SetBytesProcessed(state.iterations() * kv_bytes);
  state.SetItemsProcessed(state.iterations() * batch);
  state.SetLabel(dtype_label(dtype));
}

void paged_append(benchmark::State& state) {
  const int64_t context = state.range(0), kv_heads = state.range(1), head_dim = state.range(2);
  const int64_t dtype = state.range(3), block_size = state.range(4);
  const int64_t blocks = context / block_size + 1;
  at::Tensor k_cache = at::zeros({blocks, kv_heads, block_size, head_dim}, dtype_of(dtype));
  at::Tensor v_cache = at::zeros_like(k_cache);
  at::Tensor key = random({1, kv_heads, head_dim}, dtype), value = random({1, kv_heads, head_dim}, dtype);
  at::Tensor slot = at::full({1}, context, at::kLong);  // the token after `context` cached ones
  const PagedAppendParams params = make_append_params(key, value, k_cache, v_cache, slot);
  check_slot_values(params);
  for (auto _ : state) {
    cpu::paged_kv_append(params);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * key.numel() * static_cast<int64_t>(key.element_size()));
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(dtype_label(dtype));
}

void register_all(const Options& options) {
  auto* decode = benchmark::RegisterBenchmark("paged_decode", &paged_decode)
                     ->ArgNames({"batch", "heads", "kv_heads", "context", "head_dim", "dtype", "block_size"})
                     ->Unit(benchmark::kMicrosecond)
                     ->UseRealTime();
  auto* append = benchmark::RegisterBenchmark("paged_append", &paged_append)
                     ->ArgNames({"context", "kv_heads", "head_dim", "dtype", "block_size"})
                     ->Unit(benchmark::kMicrosecond)
                     ->UseRealTime();
  if (options.smoke) {
    decode->Args({2, 4, 2, 33, 32, 0, 16})->Args({1, 2, 1, 9, 64, 1, 1})->Iterations(1);
    append->Args({5, 2, 32, 0, 4})->Iterations(1);
    return;
  }
  if (!options.shapes.empty()) {
    for (const auto& shape : options.shapes) (shape.size() == 7 ? decode : append)->Args(shape);
    return;
  }
  // Llama-2 7B (32 x 128) and 70B GQA (64 q / 8 kv x 128) decode at batch 8, context 4096.
  for (int64_t dtype : {0, 1}) {
    decode->Args({8, 32, 32, 4096, 128, dtype, 16})->Args({8, 64, 8, 4096, 128, dtype, 16});
  }
  for (int64_t context : {512, 4096, 32768}) append->Args({context, 32, 128, 0, 16});
}

}  // namespace
}  // namespace mha_ext::bench

int main(int argc, char** argv) { return mha_ext::bench::run(argc, argv, &mha_ext::bench::register_all); }
