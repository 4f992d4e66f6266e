#pragma once
// Causal / sliding-window bounds shared by every attention kernel (see KeyWindow).
#include <cstdint>

#include "mha_ext/attention_params.h"
#include "mha_ext/macros.h"

namespace mha_ext {

// Half-open range [begin, end) of keys that query row `row` may see; empty when
// begin >= end (a fully masked row).
struct KeyRange {
  int64_t begin;
  int64_t end;
};

MHA_EXT_BEGIN_ISA_NAMESPACE

MHA_EXT_HOST_DEVICE KeyRange visible_keys(const KeyWindow& w, int64_t row, int64_t seq_k) {
  const int64_t diagonal = row + w.diagonal_offset;
  int64_t begin = w.window_left < 0 ? 0 : diagonal - w.window_left;
  int64_t end = w.window_right < 0 ? seq_k : diagonal + w.window_right + 1;
  begin = begin < 0 ? 0 : begin;
  end = end > seq_k ? seq_k : end;
  return {begin, end};
}

// Half-open range of query rows that see at least one key of [key_begin, key_end).
// Both bounds of visible_keys grow with the row, so the rows form one interval.
MHA_EXT_HOST_DEVICE KeyRange rows_seeing_keys(const KeyWindow& w, int64_t key_begin,
                                              int64_t key_end, int64_t seq_q) {
  // row sees key j  <=>  j - offset - right <= row <= j - offset + left
  int64_t begin = w.window_right < 0 ? 0 : key_begin - w.diagonal_offset - w.window_right;
  int64_t end = w.window_left < 0 ? seq_q : key_end - 1 - w.diagonal_offset + w.window_left + 1;
  begin = begin < 0 ? 0 : begin;
  end = end > seq_q ? seq_q : end;
  return {begin, end};
}

MHA_EXT_END_ISA_NAMESPACE

}  // namespace mha_ext
