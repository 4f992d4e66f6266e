#pragma once
// Plain parameter structs of the paged KV-cache ops (see attention_params.h for the rules).
// A cache is [num_blocks, num_kv_heads, block_size, head_dim] read through strides, so the
// [num_blocks, block_size, num_kv_heads, head_dim] (NHD) layout works through a permuted view.
#include <cstdint>

#include "mha_ext/attention_params.h"

namespace mha_ext {

struct CacheStrides {
  int64_t block = 0;
  int64_t head = 0;
  int64_t offset = 0;  // position inside a block
};

// Strides of a [tokens, heads, dim] tensor whose last dim is contiguous.
struct TokenStrides {
  int64_t token = 0;
  int64_t head = 0;
};

// How a paged cache stores K and V: in the dtype of the rows it caches, or in 8 bits with
// fp32 scales (QuantScales), dequantized as the kernels read them.
//  - kInt8: symmetric int8, one scale per (token, kv head) row: scale = absmax(row) / 127,
//    stored = clamp(round_half_to_even(x / scale), -127, 127) (0 for an all-zero row, whose
//    scale is 0); x_hat = stored * scale.
//  - kFloat8E4M3: float8_e4m3fn with one scale per cache tensor: stored = the e4m3fn nearest
//    (ties to even) to x / scale saturated to +-448; x_hat = stored * scale.
enum class CacheFormat : int32_t { kPlain, kInt8, kFloat8E4M3 };

// The scales of one 8-bit cache tensor. The kernels only read through `per_row`, the append
// writes through it.
struct QuantScales {
  float* per_row = nullptr;  // kInt8: [num_blocks, num_kv_heads, block_size] through `strides`
  CacheStrides strides;
  float per_tensor = 1.f;  // kFloat8E4M3 (1 otherwise)
};

struct PagedAppendParams {
  const void* key = nullptr;              // [num_tokens, num_kv_heads, head_dim]
  const void* value = nullptr;            // [num_tokens, num_kv_heads, head_dim_v]
  void* k_cache = nullptr;                // [num_blocks, num_kv_heads, block_size, head_dim]
  void* v_cache = nullptr;                // [num_blocks, num_kv_heads, block_size, head_dim_v]
  const int64_t* slot_mapping = nullptr;  // [num_tokens]; block * block_size + offset, -1 = skip
  int64_t num_tokens = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t element_size = 0;       // bytes of a key element; a plain cache takes a copy of any dtype
  DType dtype = DType::kFloat32;  // of key and value; an 8-bit cache quantizes them
  CacheFormat format = CacheFormat::kPlain;
  QuantScales k_scales, v_scales;
  TokenStrides key_strides, value_strides;
  CacheStrides k_cache_strides, v_cache_strides;
};

struct PagedAttentionParams {
  DType dtype = DType::kFloat32;  // of q and out; and of the caches where format is kPlain
  CacheFormat format = CacheFormat::kPlain;
  QuantScales k_scales, v_scales;  // of an 8-bit cache (CacheFormat)
  const void* q = nullptr;        // [total_q, num_heads, head_dim], queries of all sequences packed
  const void* k_cache = nullptr;  // [num_blocks, num_kv_heads, block_size, head_dim]
  const void* v_cache = nullptr;  // [num_blocks, num_kv_heads, block_size, head_dim_v]
  void* out = nullptr;            // [total_q, num_heads, head_dim_v]
  void* lse = nullptr;            // [total_q, num_heads] contiguous, accumulation type
  const int32_t* block_tables = nullptr;  // [batch, max_blocks_per_seq]
  const int32_t* seq_lens = nullptr;      // [batch]: cached tokens, the new ones included
  const int32_t* cu_seqlens_q = nullptr;  // [batch + 1]: sequence b owns q rows [cu[b], cu[b+1])
  int64_t batch = 0;
  int64_t max_blocks_per_seq = 0;
  int64_t block_table_stride = 0;
  int64_t total_q = 0;
  int64_t max_queries_per_seq = 0;  // largest cu_seqlens_q step: sizes the query chunks
  int64_t max_seq_len = 0;          // largest seq_lens entry: plans the key splits
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;
  int64_t block_size = 0;
  int64_t num_blocks = 0;  // blocks in the cache
  TokenStrides q_strides, out_strides;
  CacheStrides k_cache_strides, v_cache_strides;
  double scale = 1.0;
  // Sliding window: the query at position p (seq_len - num_queries + i) sees keys
  // [p - window_left, p]; -1 = unbounded (every key up to p).
  int64_t window_left = -1;
  // Softcap and ALiBi as for attention (ScoreMods), with the ALiBi distance p - j.
  ScoreMods mods;
  // [num_heads] logits, accumulation type, that join every row's softmax denominator and
  // carry no value (attention sinks); lse includes them. nullptr = none.
  const void* sinks = nullptr;

  // Split-K over long contexts: each split attends to a slice of the keys and leaves a
  // normalised partial output and its logsumexp, merged afterwards by logsumexp.
  // Workspaces in the accumulation type: partial_out [num_kv_splits, total_q, num_heads,
  // head_dim_v], partial_lse [num_kv_splits, total_q, num_heads]; unused when 1 split.
  int64_t num_kv_splits = 1;
  void* partial_out = nullptr;
  void* partial_lse = nullptr;
};

struct MergeStatesParams {
  DType dtype = DType::kFloat32;
  const void* out_a = nullptr;  // [rows, head_dim] (rows = the leading dims flattened)
  const void* out_b = nullptr;
  const void* lse_a = nullptr;  // [rows], accumulation type
  const void* lse_b = nullptr;
  void* out = nullptr;
  void* lse = nullptr;
  int64_t rows = 0;
  int64_t head_dim = 0;
  // Row strides of the [rows, head_dim] views (the leading dims must flatten to one stride).
  int64_t out_a_stride = 0, out_b_stride = 0, out_stride = 0;
};

}  // namespace mha_ext
