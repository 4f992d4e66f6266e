#pragma once
// Argument validation and params filling for the paged KV-cache ops, shared by the backends.
// Checks of index *values* read host memory, so a backend whose indices live on a device
// guards them in its kernels instead (CPU calls them before touching any data).
#include <ATen/core/Tensor.h>

#include "mha_ext/paged_params.h"

namespace mha_ext {

PagedAppendParams make_append_params(const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& slot_mapping);

// Every slot is -1 or inside the cache. slots: host memory.
void check_slot_values(const PagedAppendParams& params);

// Fills everything except out, lse and the split-K workspace.
PagedAttentionParams make_paged_attention_params(const at::Tensor& q, const at::Tensor& k_cache,
                                                 const at::Tensor& v_cache,
                                                 const at::Tensor& block_tables,
                                                 const at::Tensor& seq_lens,
                                                 const at::Tensor& cu_seqlens_q, double scale);

// cu_seqlens_q starts at 0, never decreases and ends at total_q; each sequence has at least
// as many cached tokens as queries and no more than its block table holds; every block id
// it reads is inside the cache. Sets max_queries_per_seq and max_seq_len. Index tensors:
// host memory.
void check_paged_index_values(PagedAttentionParams& params);

// paged_attention's outputs, out [total_q, heads, head_dim_v] and lse [total_q, heads], and
// with num_kv_splits > 1 the split-K workspaces, all allocated with params pointing at them.
struct PagedAttentionOutputs {
  at::Tensor out, lse;
  at::Tensor partial_out, partial_lse;  // undefined with one split
};

PagedAttentionOutputs prepare_paged_outputs(PagedAttentionParams& params, const at::Tensor& q,
                                            int64_t num_kv_splits);

// merge_attention_states' inputs as [rows, head_dim] / [rows] views (copied only when the
// leading dims do not flatten), its outputs, and the params pointing at them all: the
// backends only launch.
struct MergeStatesCall {
  MergeStatesParams params;
  at::Tensor rows_a, rows_b, lse_a, lse_b;
  at::Tensor out, lse;
};

MergeStatesCall prepare_merge_states(const at::Tensor& out_a, const at::Tensor& lse_a,
                                     const at::Tensor& out_b, const at::Tensor& lse_b);

}  // namespace mha_ext
