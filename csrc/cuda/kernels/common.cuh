#pragma once
// Device helpers shared by the CUDA kernels: element conversions, warp reductions, the
// per-element score masking and dropout of the attention kernels. Torch-free: torch's
// nvcc flags disable the implicit __half/__nv_bfloat16 conversions, so every conversion
// here is an explicit intrinsic and the same code builds inside and outside torch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "mha_ext/accumulate_type.h"
#include "mha_ext/attention_params.h"
#include "mha_ext/attn_mask.h"
#include "mha_ext/key_window.h"
#include "mha_ext/philox.h"
#include "mha_ext/score_mods.h"
#include "mha_ext/sequences.h"

namespace mha_ext::cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }

// Rounds to nearest even, as torch's own casts do.
__device__ __forceinline__ void store_as(float* dst, float x) { *dst = x; }
__device__ __forceinline__ void store_as(double* dst, double x) { *dst = x; }
__device__ __forceinline__ void store_as(__half* dst, float x) { *dst = __float2half_rn(x); }
__device__ __forceinline__ void store_as(__nv_bfloat16* dst, float x) {
  *dst = __float2bfloat16_rn(x);
}

__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }
__device__ __forceinline__ float log_of(float x) { return logf(x); }
__device__ __forceinline__ double log_of(double x) { return log(x); }

template <typename T>
__device__ __forceinline__ T warp_max(T x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x = fmax(x, __shfl_xor_sync(kFullMask, x, offset));
  }
  return x;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// The softcap and ALiBi slope of one head of one sequence (ScoreMods), read once per block.
// Every kernel, forward and backward, turns a scaled score s into
//   capped(s) + alibi bias, then masked_score adds the mask and hides the window.
template <typename acc_t>
struct HeadScoreMods {
  acc_t softcap;  // 0: none
  acc_t slope;    // 0: no ALiBi
  int64_t diagonal_offset;

  // p: a sequence's params (sequence_params), whose ALiBi slopes start at its batch entry.
  __device__ __forceinline__ static HeadScoreMods of(const AttentionForwardParams& p,
                                                     int64_t head) {
    return {static_cast<acc_t>(p.mods.softcap), alibi_slope<acc_t>(p.mods, 0, head),
            p.window.diagonal_offset};
  }
  __device__ __forceinline__ bool active() const { return softcap > 0 || slope != 0; }
  __device__ __forceinline__ acc_t capped(acc_t score) const {
    return softcap > 0 ? softcapped(score, softcap) : score;
  }
  __device__ __forceinline__ acc_t bias(int64_t row, int64_t col) const {
    return slope != 0 ? alibi_bias(slope, row, col, diagonal_offset) : acc_t(0);
  }
  __device__ __forceinline__ acc_t apply(acc_t score, int64_t row, int64_t col) const {
    return capped(score) + bias(row, col);
  }
  // d capped / d score at the capped value: 1 - (capped / softcap)^2; 1 without a softcap.
  __device__ __forceinline__ acc_t cap_derivative(acc_t capped_score) const {
    if (!(softcap > 0)) return acc_t(1);
    const acc_t ratio = capped_score / softcap;
    return acc_t(1) - ratio * ratio;
  }
};

// The score of query `row` against key `col` (col < seq_k) of one sequence's params
// (sequence_params): the modified score plus an additive mask, or -inf where the window or a
// boolean mask hides the key. The CPU kernels apply the same rule row by row
// (cpu/kernels/attention_kernel.h, mask_scores_row).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t masked_score(acc_t score, const AttentionForwardParams& p,
                                              int64_t head, int64_t row, int64_t col) {
  const KeyRange visible = visible_keys(p.window, row, p.seq_k);
  if (col < visible.begin || col >= visible.end) return -INFINITY;
  const AttnMaskParams& mask = p.mask;
  if (mask.kind == MaskKind::kNone) return score;
  const int64_t offset = mask_offset(mask, 0, head, row, col);
  if (mask.kind == MaskKind::kBool) {
    return static_cast<const bool*>(mask.data)[offset] ? score : acc_t(-INFINITY);
  }
  return score + static_cast<acc_t>(widen(static_cast<const scalar_t*>(mask.data)[offset]));
}

// The Philox words of (row, col) of one sequence: the RNG's batch coordinate is the
// sequence's index in the call (DropoutParams::batch_offset).
__device__ __forceinline__ Philox4x32 sequence_dropout_bits(const DropoutParams& dropout,
                                                            int64_t head, int64_t row,
                                                            int64_t col) {
  return dropout_bits(dropout.seed, dropout.batch_offset, head, row, col);
}

__device__ __forceinline__ bool sequence_dropout_keeps(const DropoutParams& dropout, int64_t head,
                                                       int64_t row, int64_t col) {
  return dropout_word_kept(dropout, sequence_dropout_bits(dropout, head, row, col).word[col & 3]);
}

// Dropout of one probability with the shared Philox counters (mha_ext/philox.h): kept
// values are scaled by 1 / (1 - dropout_p), dropped ones become 0.
template <typename acc_t>
__device__ __forceinline__ acc_t apply_dropout(acc_t value, const DropoutParams& dropout,
                                               int64_t head, int64_t row, int64_t col) {
  return sequence_dropout_keeps(dropout, head, row, col)
             ? value * static_cast<acc_t>(dropout.keep_scale)
             : acc_t(0);
}

// The softmax of a row that saw keys with running max `row_max` and sum `row_sum` (relative
// to the max), joined by the sink logit `sink` (-inf: none): the factor that normalises the
// row's accumulated output and the row's logsumexp. A row that saw no key (sum 0) gets
// factor 0 and lse = sink.
template <typename acc_t>
struct RowFinish {
  acc_t out_factor;
  acc_t lse;
};

template <typename acc_t>
__device__ __forceinline__ RowFinish<acc_t> finish_row(acc_t row_max, acc_t row_sum, acc_t sink) {
  if (row_sum == acc_t(0)) return {acc_t(0), sink};
  // Rebased on the larger of the two, so that a sink far above the scores cannot overflow.
  const acc_t top = fmax(row_max, sink);
  const acc_t rescale = exp_of(row_max - top);
  const acc_t total = row_sum * rescale + exp_of(sink - top);
  return {rescale / total, top + log_of(total)};
}

}  // namespace mha_ext::cuda
