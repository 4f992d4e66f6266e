// Paged KV cache kernels on the CPU, driven through the params structs with no Python:
// decode attention (one query per sequence; bytes/s counts the K/V read) and append (one
// token per call; bytes/s counts the K/V written). Beside decode, what bounds it: the same
// cache rows read in the same order with no arithmetic (paged_reads), and a contiguous buffer
// of the same size read straight through (stream_read). OMP_NUM_THREADS=1 gives one core's.
//
//   paged_bench [--smoke] [--shape=... ...] [--benchmark_filter=...]
// paged_decode and paged_reads arguments: batch, heads, kv_heads, context, head_dim, dtype
// (0 fp32, 1 bf16, 2 fp16), block_size. stream_read: the same, of which it reads the K/V bytes.
// paged_append arguments: context, kv_heads, head_dim, dtype, block_size.
// --shape=... with 7 numbers adds a run of the three with those arguments, with 5 a
// paged_append run, instead of the built-in argument lists.
#include <ATen/Parallel.h>

#include <numeric>

#include "bench_common.h"
#include "cpu/backend.h"
#include "cpu/kernels/kernels.h"
#include "ops/paged.h"

namespace mha_ext::bench {
namespace {

// One decode step's inputs: a cache of `batch` sequences of `context` tokens, each
// sequence's blocks scattered, and one query per sequence.
struct DecodeStep {
  int64_t batch, heads, kv_heads, context, head_dim, dtype, block_size;
  at::Tensor k_cache, v_cache;  // [batch * blocks_per_seq, kv_heads, block_size, head_dim]
  at::Tensor tables;            // [batch, blocks_per_seq] int32
  at::Tensor q;                 // [batch, heads, head_dim]

  explicit DecodeStep(const benchmark::State& state)
      : batch(state.range(0)),
        heads(state.range(1)),
        kv_heads(state.range(2)),
        context(state.range(3)),
        head_dim(state.range(4)),
        dtype(state.range(5)),
        block_size(state.range(6)) {
    const int64_t blocks_per_seq = (context + block_size - 1) / block_size;
    k_cache = random({batch * blocks_per_seq, kv_heads, block_size, head_dim}, dtype);
    v_cache = random({batch * blocks_per_seq, kv_heads, block_size, head_dim}, dtype);
    // Sequence b owns blocks b, b + batch, b + 2 batch, ...: scattered, as after real use.
    tables =
        at::arange(batch * blocks_per_seq, at::kInt).view({blocks_per_seq, batch}).t().contiguous();
    q = random({batch, heads, head_dim}, dtype);
  }

  // The K and V bytes a step reads.
  int64_t kv_bytes() const {
    return 2 * k_cache.numel() * static_cast<int64_t>(k_cache.element_size());
  }

  void report(benchmark::State& state) const {
    state.SetBytesProcessed(state.iterations() * kv_bytes());
    state.SetItemsProcessed(state.iterations() * batch);
    state.SetLabel(dtype_label(dtype));
  }
};

void paged_decode(benchmark::State& state) {
  const DecodeStep step(state);
  at::Tensor seq_lens = at::full({step.batch}, step.context, at::kInt);
  at::Tensor cu_seqlens = at::arange(step.batch + 1, at::kInt);
  PagedAttentionParams params = make_paged_attention_params(
      step.q, step.k_cache, step.v_cache, step.tables, seq_lens, cu_seqlens,
      1.0 / std::sqrt(static_cast<double>(step.head_dim)), /*window_left=*/-1, /*softcap=*/0.0,
      /*alibi_slopes=*/std::nullopt, /*sinks=*/std::nullopt, /*k_scales=*/std::nullopt,
      /*v_scales=*/std::nullopt, /*k_scale=*/1.0, /*v_scale=*/1.0, cpu::Backend::kIndicesOnHost);
  const auto plan = cpu::Backend::plan(params, step.q);  // the op's plan
  const PagedAttentionTensors tensors = allocate_paged_tensors(params, step.q);
  for (auto _ : state) {
    cpu::Backend::run(params, plan);
    benchmark::DoNotOptimize(tensors.out.data_ptr());
  }
  step.report(state);
}

// Sum of the whole 64-bit words in bytes [0, size) of row: an integer sum, so the compiler may
// vectorise it in any order.
inline uint64_t sum_words(const void* row, int64_t size) {
  const uint64_t* words = static_cast<const uint64_t*>(row);
  uint64_t sum = 0;
  for (int64_t i = 0; i < size / 8; ++i) sum += words[i];
  return sum;
}

// Requests the cache lines of bytes [0, size) of row.
inline void request_row(const void* row, int64_t size) {
  for (int64_t byte = 0; byte < size; byte += 64)
    __builtin_prefetch(static_cast<const char*>(row) + byte, 0, 2);
}

// The cache rows paged_decode reads, in the order its tasks read them when a task takes all
// kv heads of a sequence (the plan for 8 sequences on 2 threads): per 64-key tile, head by
// head, the tile's key rows and then its value rows. Reads alone, each row requested
// kRowsAhead rows before it is read: the rate these rows can be read at in this order by a
// loop with nothing else to do.
void paged_reads(benchmark::State& state) {
  const DecodeStep step(state);
  constexpr int64_t kTileKeys = 64, kRowsAhead = 16;
  const int64_t row_bytes = step.head_dim * static_cast<int64_t>(step.k_cache.element_size());
  const int64_t blocks_per_seq = step.tables.size(1);
  const int32_t* tables = step.tables.data_ptr<int32_t>();
  const char* caches[2] = {static_cast<const char*>(step.k_cache.data_ptr()),
                           static_cast<const char*>(step.v_cache.data_ptr())};
  const int64_t head_bytes = step.block_size * row_bytes, block_bytes = step.kv_heads * head_bytes;
  std::vector<uint64_t> sums(step.batch);
  for (auto _ : state) {
    at::parallel_for(0, step.batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<const char*> rows;  // the sequence's rows in the order they are read
      for (int64_t seq = begin; seq < end; ++seq) {
        rows.clear();
        for (int64_t key0 = 0; key0 < step.context; key0 += kTileKeys) {
          const int64_t keys = std::min(kTileKeys, step.context - key0);
          for (int64_t head = 0; head < step.kv_heads; ++head) {
            for (const char* cache : caches) {
              for (int64_t key = key0; key < key0 + keys; ++key) {
                const int64_t block = tables[seq * blocks_per_seq + key / step.block_size];
                rows.push_back(cache + block * block_bytes + head * head_bytes +
                               key % step.block_size * row_bytes);
              }
            }
          }
        }
        uint64_t sum = 0;
        const int64_t count = static_cast<int64_t>(rows.size());
        for (int64_t i = 0; i < count; ++i) {
          if (i + kRowsAhead < count) request_row(rows[i + kRowsAhead], row_bytes);
          sum += sum_words(rows[i], row_bytes);
        }
        sums[seq] = sum;
      }
    });
    benchmark::DoNotOptimize(sums.data());
  }
  step.report(state);
}

// A contiguous buffer of a decode step's K/V bytes read straight through, split evenly over
// the threads: the streaming rate the benchmark suite's "% roofline" divides by.
void stream_read(benchmark::State& state) {
  const DecodeStep step(state);
  const int64_t words = step.kv_bytes() / 8;
  at::Tensor buffer = at::ones({words}, at::kLong);  // touched, so its pages exist
  const uint64_t* data = reinterpret_cast<const uint64_t*>(buffer.data_ptr<int64_t>());
  std::vector<uint64_t> sums(at::get_num_threads());
  for (auto _ : state) {
    const int64_t per_thread = (words + at::get_num_threads() - 1) / at::get_num_threads();
    at::parallel_for(0, words, per_thread, [&](int64_t begin, int64_t end) {
      sums[at::get_thread_num()] = sum_words(data + begin, (end - begin) * 8);
    });
    benchmark::DoNotOptimize(sums.data());
  }
  step.report(state);
}

void paged_append(benchmark::State& state) {
  const int64_t context = state.range(0), kv_heads = state.range(1), head_dim = state.range(2);
  const int64_t dtype = state.range(3), block_size = state.range(4);
  const int64_t blocks = context / block_size + 1;
  at::Tensor k_cache = at::zeros({blocks, kv_heads, block_size, head_dim}, dtype_of(dtype));
  at::Tensor v_cache = at::zeros_like(k_cache);
  at::Tensor key = random({1, kv_heads, head_dim}, dtype),
             value = random({1, kv_heads, head_dim}, dtype);
  at::Tensor slot = at::full({1}, context, at::kLong);  // the token after `context` cached ones
  const PagedAppendParams params = make_append_params(
      key, value, k_cache, v_cache, slot, /*k_scales=*/std::nullopt,
      /*v_scales=*/std::nullopt, /*k_scale=*/1.0, /*v_scale=*/1.0, cpu::Backend::kIndicesOnHost);
  for (auto _ : state) {
    cpu::paged_kv_append(params);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * key.numel() *
                          static_cast<int64_t>(key.element_size()));
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(dtype_label(dtype));
}

void register_all(const Options& options) {
  // The decode step, its reads alone and the streaming rate take the same arguments, and run
  // one after another for each.
  std::vector<benchmark::internal::Benchmark*> decode;
  for (auto [name, function] :
       {std::pair{"paged_decode", &paged_decode}, std::pair{"paged_reads", &paged_reads},
        std::pair{"stream_read", &stream_read}}) {
    decode.push_back(
        benchmark::RegisterBenchmark(name, function)
            ->ArgNames({"batch", "heads", "kv_heads", "context", "head_dim", "dtype", "block_size"})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime());
  }
  auto add_decode = [&](const std::vector<int64_t>& args) {
    for (auto* run : decode) run->Args(args);
  };
  auto* append = benchmark::RegisterBenchmark("paged_append", &paged_append)
                     ->ArgNames({"context", "kv_heads", "head_dim", "dtype", "block_size"})
                     ->Unit(benchmark::kMicrosecond)
                     ->UseRealTime();
  if (options.smoke) {
    add_decode({2, 4, 2, 33, 32, 0, 16});
    add_decode({1, 2, 1, 9, 64, 1, 1});
    for (auto* run : decode) run->Iterations(1);
    append->Args({5, 2, 32, 0, 4})->Iterations(1);
    return;
  }
  if (!options.shapes.empty()) {
    for (const auto& shape : options.shapes) {
      if (shape.size() == 7) {
        add_decode(shape);
      } else {
        append->Args(shape);
      }
    }
    return;
  }
  // Llama-2 7B (32 x 128), the 32 q / 8 kv target shape and 70B GQA (64 q / 8 kv x 128)
  // decode at batch 8, context 4096.
  for (int64_t dtype : {0, 1}) {
    for (int64_t heads : {32, 64}) add_decode({8, heads, 8, 4096, 128, dtype, 16});
    add_decode({8, 32, 32, 4096, 128, dtype, 16});
  }
  for (int64_t context : {512, 4096, 32768}) append->Args({context, 32, 128, 0, 16});
}

}  // namespace
}  // namespace mha_ext::bench

int main(int argc, char** argv) {
  return mha_ext::bench::run(argc, argv, &mha_ext::bench::register_all);
}
