#pragma once
// The score modifications of ScoreMods (logit softcap, ALiBi) and the attention sink, shared
// by every kernel so that all of them, forward and backward, compute the same scores.
#include <cmath>
#include <cstdint>

#include "mha_ext/attention_params.h"
#include "mha_ext/macros.h"

namespace mha_ext {

MHA_EXT_BEGIN_ISA_NAMESPACE

// softcap * tanh(s / softcap); the backward multiplies dS by its derivative
// 1 - tanh^2 = 1 - (capped / softcap)^2.
template <typename acc_t>
MHA_EXT_HOST_DEVICE acc_t softcapped(acc_t score, acc_t softcap) {
  return softcap * std::tanh(score / softcap);
}

// The ALiBi slope of (batch, head), 0 without ALiBi. acc_t is the accumulation type the
// slopes are stored in.
template <typename acc_t>
MHA_EXT_HOST_DEVICE acc_t alibi_slope(const ScoreMods& mods, int64_t batch, int64_t head) {
  if (mods.alibi_slopes == nullptr) return acc_t(0);
  return static_cast<const acc_t*>(mods.alibi_slopes)[batch * mods.alibi_batch_stride + head];
}

// The ALiBi bias of query row `row` and key `key`: -slope * |row + diagonal_offset - key|,
// FlashAttention's convention (the distance to the diagonal the causal alignment chooses).
template <typename acc_t>
MHA_EXT_HOST_DEVICE acc_t alibi_bias(acc_t slope, int64_t row, int64_t key,
                                     int64_t diagonal_offset) {
  const int64_t distance = row + diagonal_offset - key;
  return -slope * static_cast<acc_t>(distance < 0 ? -distance : distance);
}

// The sink logit of `head`, -inf without sinks (exp(-inf) = 0 leaves the softmax as it is).
template <typename acc_t>
MHA_EXT_HOST_DEVICE acc_t sink_logit(const void* sinks, int64_t head) {
  if (sinks == nullptr) return -INFINITY;
  return static_cast<const acc_t*>(sinks)[head];
}

MHA_EXT_END_ISA_NAMESPACE

}  // namespace mha_ext
