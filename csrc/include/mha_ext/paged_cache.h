#pragma once
// Paged-cache index math and the merge of partial softmax states, shared by every backend.
#include <cmath>
#include <cstdint>

#include "mha_ext/macros.h"

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

// The slot holding token `position` of a sequence whose blocks are listed in block_table.
MHA_EXT_HOST_DEVICE int64_t slot_of_position(const int32_t* block_table, int64_t position,
                                            int64_t block_size) {
  return static_cast<int64_t>(block_table[position / block_size]) * block_size +
         position % block_size;
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
