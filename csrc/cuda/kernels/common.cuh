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

// The score of query `row` against key `col` (col < seq_k): the scaled dot product plus an
// additive mask, or -inf where the window or a boolean mask hides the key. The CPU kernels
// apply the same rule row by row (cpu/kernels/attention_kernel.h, mask_scores_row).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t masked_score(acc_t score, const AttentionForwardParams& p,
                                              int64_t batch, int64_t head, int64_t row,
                                              int64_t col) {
  const KeyRange visible = visible_keys(p.window, row, p.seq_k);
  if (col < visible.begin || col >= visible.end) return -INFINITY;
  const AttnMaskParams& mask = p.mask;
  if (mask.kind == MaskKind::kNone) return score;
  const int64_t offset = mask_offset(mask, batch, head, row, col);
  if (mask.kind == MaskKind::kBool) {
    return static_cast<const bool*>(mask.data)[offset] ? score : acc_t(-INFINITY);
  }
  return score + static_cast<acc_t>(widen(static_cast<const scalar_t*>(mask.data)[offset]));
}

// Dropout of one probability with the shared Philox counters (mha_ext/philox.h): kept
// values are scaled by 1 / (1 - dropout_p), dropped ones become 0.
template <typename acc_t>
__device__ __forceinline__ acc_t apply_dropout(acc_t value, const DropoutParams& dropout,
                                               int64_t batch, int64_t head, int64_t row,
                                               int64_t col) {
  return dropout_keeps(dropout, batch, head, row, col)
             ? value * static_cast<acc_t>(dropout.keep_scale)
             : acc_t(0);
}

}  // namespace mha_ext::cuda
