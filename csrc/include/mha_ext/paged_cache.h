#pragma once
// Paged-cache index math and the merge of partial softmax states, shared by every backend:
// where a token's rows lie in the cache, which keys a paged query sees, which keys a split
// of them takes.
#include <cmath>
#include <cstdint>

#include "mha_ext/key_window.h"
#include "mha_ext/macros.h"
#include "mha_ext/paged_params.h"

namespace mha_ext {

// A flat slot names a position in the cache: slot = block * block_size + offset.
struct CacheSlot {
  int64_t block;
  int64_t offset;
};

MHA_EXT_BEGIN_ISA_NAMESPACE

MHA_EXT_HOST_DEVICE CacheSlot slot_location(int64_t slot, int64_t block_size) {
  return {slot / block_size, slot % block_size};
}

// Where token `position` of a sequence lies, its blocks listed in block_table: the block as
// the table names it (not checked against the cache) and the offset inside it.
MHA_EXT_HOST_DEVICE CacheSlot position_location(const int32_t* block_table, int64_t position,
                                                int64_t block_size) {
  return {static_cast<int64_t>(block_table[position / block_size]), position % block_size};
}

// Element offset of kv head `head`'s row at `location` in a cache with these strides.
MHA_EXT_HOST_DEVICE int64_t cache_row_offset(const CacheStrides& strides, CacheSlot location,
                                             int64_t head) {
  return location.block * strides.block + head * strides.head + location.offset * strides.offset;
}

// Paged attention's causal rule: a sequence's queries are its last tokens, so query i of its
// num_queries (counted within the sequence) is token seq_len - num_queries + i, and sees the
// keys up to itself (bottom-right alignment).
MHA_EXT_HOST_DEVICE int64_t paged_query_position(int64_t seq_len, int64_t num_queries,
                                                 int64_t query) {
  return seq_len - num_queries + query;
}

// The keys [0, paged_keys_seen) that query `query` sees without a window. Never negative: the
// CUDA kernels clamp seq_len to what a block-table row holds, which can leave a query before
// the first token, seeing no key (the CPU op rejects such lengths).
MHA_EXT_HOST_DEVICE int64_t paged_keys_seen(int64_t seq_len, int64_t num_queries, int64_t query) {
  const int64_t keys = paged_query_position(seq_len, num_queries, query) + 1;
  return keys > 0 ? keys : 0;
}

// The keys [begin, end) that query `query` sees: those up to itself, and with a window
// (window_left >= 0) none before its position - window_left. Empty (begin = end) where
// paged_keys_seen is 0.
MHA_EXT_HOST_DEVICE KeyRange paged_visible_keys(int64_t seq_len, int64_t num_queries, int64_t query,
                                                int64_t window_left) {
  const int64_t end = paged_keys_seen(seq_len, num_queries, query);
  const int64_t begin = window_left < 0 ? 0 : end - 1 - window_left;
  return {begin < 0 ? 0 : begin, end};
}

// The keys a chunk of a sequence's queries [first_query, last_query] sees together: from the
// first query's first key to the last query's last (both bounds grow with the query).
MHA_EXT_HOST_DEVICE KeyRange paged_chunk_keys(int64_t seq_len, int64_t num_queries,
                                              int64_t first_query, int64_t last_query,
                                              int64_t window_left) {
  const int64_t begin = paged_visible_keys(seq_len, num_queries, first_query, window_left).begin;
  const int64_t end = paged_keys_seen(seq_len, num_queries, last_query);
  return {begin < end ? begin : end, end};
}

// The most keys a chunk of up to `queries` queries of one sequence sees: what the key splits
// are planned for. A window bounds it below the longest sequence (a 4096-key window over 32k
// tokens reads 4096 keys, not 32k).
MHA_EXT_HOST_DEVICE int64_t paged_max_chunk_keys(const PagedAttentionParams& p, int64_t queries) {
  const int64_t windowed = p.window_left + queries;
  return p.window_left < 0 || windowed > p.max_seq_len ? p.max_seq_len : windowed;
}

// Keys [begin, end) that split `split` of `splits` takes of keys: equal shares rounded up to
// whole tiles of tile_keys from keys.begin, so every split starts on a tile boundary and only
// the last nonempty one ends inside a tile; splits past the keys are empty (begin = end =
// keys.end). The splits together take every key once.
MHA_EXT_HOST_DEVICE KeyRange split_key_range(KeyRange keys, int64_t split, int64_t splits,
                                             int64_t tile_keys) {
  const int64_t count = keys.end - keys.begin;
  const int64_t share = ((count + splits - 1) / splits + tile_keys - 1) / tile_keys * tile_keys;
  const int64_t begin = split * share < count ? split * share : count;
  const int64_t end = begin + share < count ? begin + share : count;
  return {keys.begin + begin, keys.begin + end};
}

MHA_EXT_END_ISA_NAMESPACE

// Two attentions over disjoint key sets A and B, each normalised over its own keys, combine
// into the attention over A and B as out = weight_a * out_a + weight_b * out_b with
// lse = log(exp(lse_a) + exp(lse_b)). An empty side (lse -inf) gets weight 0, and two
// empty sides give weights 0 and lse -inf, never NaN.
template <typename T>
struct MergedState {
  T weight_a;
  T weight_b;
  T lse;
};

MHA_EXT_BEGIN_ISA_NAMESPACE

template <typename T>
MHA_EXT_HOST_DEVICE MergedState<T> merge_softmax_states(T lse_a, T lse_b) {
  const T max_lse = lse_a > lse_b ? lse_a : lse_b;
  if (max_lse == -INFINITY) return {T(0), T(0), max_lse};
  // std:: names the float overloads; unqualified exp and log found the C library's double
  // versions on the host, and host and device then merged with different functions.
  const T scaled_a = std::exp(lse_a - max_lse);
  const T scaled_b = std::exp(lse_b - max_lse);
  const T total = scaled_a + scaled_b;
  return {scaled_a / total, scaled_b / total, max_lse + std::log(total)};
}

MHA_EXT_END_ISA_NAMESPACE

}  // namespace mha_ext
