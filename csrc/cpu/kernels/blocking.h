#pragma once
// Tile sizes of the CPU attention kernels, also needed by the op layer to size workspaces.
#include <algorithm>
#include <cstdint>

#include "mha_ext/attention_params.h"
#include "mha_ext/paged_cache.h"
#include "mha_ext/paged_params.h"

namespace mha_ext::cpu {

// Rows of the query and key blocks that the kernels tile attention into. 64 x 64 tiles: at
// head_dim 128 a forward task's Q and O tiles for its up to 8 sub-blocks plus one K^T, V
// and S tile take about 600 KiB of fp32 scratch, inside a core's L2, and each K/V tile
// converted to fp32 serves up to 8 x 64 query rows. 128-key tiles measured slower here.
constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 64;

// Up to this many tile rows (decode: the heads of one GQA group), the paged kernel uses keys
// and values row by row straight from the cache; gathering them into K^T / V tiles for the
// GEMM costs more than the GEMM saves when it feeds so few rows (llama2-70b's 8-head groups
// decoded 1.15-1.25x faster direct: 8 x 64q/8kv, context 4096, from memory, 12.1-13.0 ->
// 13.9-14.8 GB/s fp32 and 7.9-8.4 -> 9.9-10.2 bf16). Measured on the AVX-512 Xeon; one value
// for every ISA class, as the task planner (plan_paged_tasks) runs before the ISA dispatch.
// Check: build/cmake/paged_bench --benchmark_filter='paged_decode/batch:8/heads:64/kv_heads:8/'
constexpr int64_t kDirectRows = 8;

// Queries of one sequence that a paged task's tile takes: its rows are (query, head of the
// GQA group) pairs, as many queries as fill a query block.
inline int64_t paged_queries_per_tile(const PagedAttentionParams& p) {
  return std::max<int64_t>(1, kQueryBlock / (p.num_heads / p.num_kv_heads));
}

// Query rows of the paged kernel's largest task for one kv head: queries of a sequence (at
// most a tile's worth) times the heads of a GQA group.
inline int64_t paged_task_rows(const PagedAttentionParams& p) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  return std::min(std::max<int64_t>(p.max_queries_per_seq, 1), paged_queries_per_tile(p)) * group;
}

// The CPU backend's plan of a paged_attention call, which the kernel takes beside the params.
struct PagedTaskPlan {
  int64_t kv_heads_per_task;  // kv heads of one sequence a task takes together
  int64_t kv_splits;          // = params.num_kv_splits
};

// How the paged kernel divides its work among `threads` threads, aiming at two tasks per
// thread. Where every task's rows fit the direct path (decode), a task takes all kv heads of
// its sequence and visits them head by head within each key tile: a cache block holds its
// heads' rows side by side, so the task's reads sweep through whole blocks, where one head's
// tiles in turn read 8 KiB of every 64 KiB block (fp32, 8 kv heads, block size 16). Only the
// reads, on Zen 5 from memory: 18-19 -> 25-28 GB/s on one core, 26-31 -> 42 on two. Long
// contexts are split along the keys when the tasks leave threads idle (a split below 256 keys
// would cost more in merging than it saves; a window counts only the keys a task sees), and a
// sequence's heads are divided among tasks only when the splits cannot fill the threads.
inline PagedTaskPlan plan_paged_tasks(const PagedAttentionParams& p, int64_t threads) {
  const bool heads_together = paged_task_rows(p) <= kDirectRows;
  const int64_t wanted = 2 * std::max<int64_t>(threads, 1);
  const int64_t tasks = std::max<int64_t>(p.batch * (heads_together ? 1 : p.num_kv_heads), 1);
  const int64_t keys = paged_max_chunk_keys(
      p, std::min(std::max<int64_t>(p.max_queries_per_seq, 1), paged_queries_per_tile(p)));
  const int64_t splits = std::max<int64_t>(1, std::min((wanted + tasks - 1) / tasks, keys / 256));
  if (!heads_together) return {1, splits};
  const int64_t head_groups =
      std::clamp<int64_t>((wanted + tasks * splits - 1) / (tasks * splits), 1, p.num_kv_heads);
  return {(p.num_kv_heads + head_groups - 1) / head_groups, splits};
}

// The CPU backend's workspaces of an attention call, which the bf16 kernels on brgemm need
// (where one is nullptr, bf16 runs on the fp32 tiles). Borrowed for the call.
struct AttentionWorkspaces {
  void* kv_pairs = nullptr;               // forward: kv_pairs_size values of q's dtype
  void* q_grad_out_transposed = nullptr;  // backward: q_grad_out_transposed_size values
};

// Most keys per tile of the bf16 forward (bf16_key_tile in attention_kernel.h).
constexpr int64_t kMaxBf16KeyTile = 256;

// Values of q's dtype in the bf16 forward's workspace AttentionWorkspaces::kv_pairs: room for
// every key tile's K and V of each (batch, kv head), in brgemm's pair layout.
inline int64_t kv_pairs_size(const AttentionForwardParams& p) {
  const int64_t keys = (p.seq_k + kMaxBf16KeyTile - 1) / kMaxBf16KeyTile * kMaxBf16KeyTile;
  return p.batch * p.num_kv_heads * keys * (p.head_dim + p.head_dim_v);
}

// Columns of each row of the bf16 backward's Q^T and dO^T: every query block, and 32 more so
// that rows are not a multiple of 4 KiB apart (brgemm's 16-row tile loads from such rows all
// fall in one L1 set).
inline int64_t transposed_row_length(int64_t seq_q) {
  return (seq_q + kQueryBlock - 1) / kQueryBlock * kQueryBlock + 32;
}

// Values of q's dtype in the bf16 backward's workspace AttentionWorkspaces::
// q_grad_out_transposed: [batch, num_heads, head_dim + head_dim_v, transposed_row_length].
// Q and dO with rows as columns, Q^T above dO^T: the products dK^T = Q^T dS and dV^T = dO^T P
// read them.
inline int64_t q_grad_out_transposed_size(const AttentionForwardParams& p) {
  return p.batch * p.num_heads * (p.head_dim + p.head_dim_v) * transposed_row_length(p.seq_q);
}

}  // namespace mha_ext::cpu
