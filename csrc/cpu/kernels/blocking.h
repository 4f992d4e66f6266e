#pragma once
// Tile sizes of the CPU attention kernels, also needed by the op layer to size workspaces.
#include <cstdint>

#include "mha_ext/attention_params.h"

namespace mha_ext::cpu {

// Rows of the query and key blocks that the kernels tile attention into. 64 x 64 tiles: at
// head_dim 128 a forward task's Q and O tiles for its up to 8 sub-blocks plus one K^T, V
// and S tile take about 600 KiB of fp32 scratch, inside a core's L2, and each K/V tile
// converted to fp32 serves up to 8 x 64 query rows. 128-key tiles measured slower here.
constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 64;

// Most keys per tile of the bf16 forward (bf16_key_tile in attention_kernel.h).
constexpr int64_t kMaxBf16KeyTile = 128;

// Values of q's dtype in the bf16 forward's workspace AttentionForwardParams::kv_pairs: room
// for every key tile's K and V of each (batch, kv head), in brgemm's pair layout.
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

// Values of q's dtype in the bf16 backward's workspace AttentionBackwardParams::
// q_grad_out_transposed: [batch, num_heads, head_dim + head_dim_v, transposed_row_length].
inline int64_t q_grad_out_transposed_size(const AttentionForwardParams& p) {
  return p.batch * p.num_heads * (p.head_dim + p.head_dim_v) * transposed_row_length(p.seq_q);
}

}  // namespace mha_ext::cpu
