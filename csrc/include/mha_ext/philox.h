#pragma once
// Counter-based dropout RNG shared by the CPU and CUDA kernels.
//
// Philox4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011) maps a 128-bit counter and a 64-bit key to four 32-bit random words. Because the
// words depend only on (key, counter), the backward regenerates exactly the forward's
// dropout mask from the seed alone: nothing O(seq_q x seq_k) is stored, and every backend
// that uses these functions draws the same mask for the same seed.
#include <cstdint>

#include "mha_ext/attention_params.h"
#include "mha_ext/macros.h"

namespace mha_ext {

struct Philox4x32 {
  uint32_t word[4];
};

MHA_EXT_BEGIN_ISA_NAMESPACE

MHA_EXT_HOST_DEVICE Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                             uint64_t key) {
  // Round multipliers and Weyl key increments from the paper.
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

// The four random words covering keys [col & ~3, (col & ~3) + 4) of one attention row.
// Counter = (column group, row, head, batch): unique per element for any tensor with
// fewer than 2^32 rows, heads and batches and 2^34 columns.
MHA_EXT_HOST_DEVICE Philox4x32 dropout_bits(uint64_t seed, int64_t batch, int64_t head, int64_t row,
                                            int64_t col) {
  return philox4x32_10(static_cast<uint32_t>(col >> 2), static_cast<uint32_t>(row),
                       static_cast<uint32_t>(head), static_cast<uint32_t>(batch), seed);
}

// Elements whose random word falls below the threshold are dropped.
MHA_EXT_HOST_DEVICE uint32_t dropout_threshold(double dropout_p) {
  const double threshold = dropout_p * 4294967296.0;  // p * 2^32
  return threshold >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(threshold);
}

// Whether the element that drew `word` survives dropout.
MHA_EXT_HOST_DEVICE bool dropout_word_kept(const DropoutParams& d, uint32_t word) {
  return word >= d.drop_threshold;
}

MHA_EXT_HOST_DEVICE bool dropout_keeps(const DropoutParams& d, int64_t batch, int64_t head,
                                       int64_t row, int64_t col) {
  return dropout_word_kept(d, dropout_bits(d.seed, batch, head, row, col).word[col & 3]);
}

MHA_EXT_END_ISA_NAMESPACE

}  // namespace mha_ext
