#pragma once
// The generic (SIMT) attention core shared by the dense forward and the paged attention:
// a block of 4 warps owns 16 query rows (4 per warp) and streams key tiles of 32 keys
// through shared memory, one key per lane. Any element type and head dim up to 256; the
// tensor-core kernels cover the common fp16/bf16 shapes faster.
//
// Per key tile each lane computes its key's score for the warp's 4 rows, the online
// softmax takes warp-wide max/sum, and O += P V broadcasts each key's probability to all
// lanes, lane l owning output dims l, l + 32, ...
#include <type_traits>

#include "common.cuh"

namespace mha_ext::cuda {

constexpr int kSimtWarps = 4;
constexpr int kSimtThreads = kSimtWarps * kWarpSize;
constexpr int kSimtRowsPerWarp = 4;
constexpr int kSimtRows = kSimtWarps * kSimtRowsPerWarp;  // query rows per block
constexpr int kSimtKeys = kWarpSize;                      // keys per tile: one per lane

// Output dims per lane: head dims up to 32 * kDimChunks.
template <typename Launch>
bool dispatch_dim_chunks(int64_t head_dim_v, Launch&& launch) {
  if (head_dim_v <= 64) return launch(std::integral_constant<int, 2>{});
  if (head_dim_v <= 128) return launch(std::integral_constant<int, 4>{});
  return launch(std::integral_constant<int, 8>{});
}

// Shared memory of the core, in acc_t elements: q_tile [kSimtRows, head_dim] (scaled),
// k_tile [kSimtKeys, head_dim + 1] (the odd row stride keeps lanes reading one column of
// different rows on different banks), v_tile [kSimtKeys, head_dim_v].
struct SimtTiles {
  int64_t head_dim;
  int64_t head_dim_v;
  __host__ __device__ int64_t k_ld() const { return head_dim + 1; }
  __host__ __device__ int64_t elements() const {
    return kSimtRows * head_dim + kSimtKeys * k_ld() + kSimtKeys * head_dim_v;
  }
};

// Dot product of a q_tile row with k_tile row `key`.
template <typename acc_t>
__device__ __forceinline__ acc_t row_key_dot(const acc_t* q_row, const acc_t* k_tile, int64_t k_ld,
                                             int key, int64_t head_dim) {
  const acc_t* k_row = k_tile + key * k_ld;
  acc_t dot = 0;
  for (int64_t d = 0; d < head_dim; ++d) dot += q_row[d] * k_row[d];
  return dot;
}

// Online-softmax state and output accumulator of one warp's rows.
template <typename acc_t, int kDimChunks>
struct SimtRows {
  acc_t acc[kSimtRowsPerWarp][kDimChunks];
  acc_t row_max[kSimtRowsPerWarp];
  acc_t row_sum[kSimtRowsPerWarp];

  __device__ void init() {
#pragma unroll
    for (int i = 0; i < kSimtRowsPerWarp; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0;
#pragma unroll
      for (int c = 0; c < kDimChunks; ++c) acc[i][c] = 0;
    }
  }

  // scores: this lane's key's score for each row (-inf where hidden). Returns in place the
  // probabilities exp(score - running max); the sum and the accumulator follow the max.
  __device__ void softmax_step(acc_t (&scores)[kSimtRowsPerWarp]) {
#pragma unroll
    for (int i = 0; i < kSimtRowsPerWarp; ++i) {
      const acc_t new_max = fmax(row_max[i], warp_max(scores[i]));
      // While a row has seen no key, its max stays -inf and its probabilities 0.
      const bool empty = new_max == acc_t(-INFINITY);
      const acc_t rescale = empty ? acc_t(1) : exp_of(row_max[i] - new_max);
      scores[i] = empty ? acc_t(0) : exp_of(scores[i] - new_max);
      row_sum[i] = row_sum[i] * rescale + warp_sum(scores[i]);
      row_max[i] = new_max;
#pragma unroll
      for (int c = 0; c < kDimChunks; ++c) acc[i][c] *= rescale;
    }
  }

  // acc += P V for the tile: probs holds this lane's key's (possibly dropped) probability
  // per row; v_tile rows past the tile's keys are zero and their probabilities 0.
  __device__ void accumulate(const acc_t (&probs)[kSimtRowsPerWarp], const acc_t* v_tile,
                             int64_t head_dim_v, int lane) {
#pragma unroll 4
    for (int key = 0; key < kSimtKeys; ++key) {
      const acc_t* v_row = v_tile + key * head_dim_v;
#pragma unroll
      for (int i = 0; i < kSimtRowsPerWarp; ++i) {
        const acc_t prob = __shfl_sync(kFullMask, probs[i], key);
#pragma unroll
        for (int c = 0; c < kDimChunks; ++c) {
          const int64_t d = lane + c * kWarpSize;
          if (d < head_dim_v) acc[i][c] += prob * v_row[d];
        }
      }
    }
  }

  // Writes row i normalised into out_row (head_dim_v elements of out_t), the sink logit
  // `sink` (-inf: none) joining the denominator, and returns its logsumexp: 0 output and
  // lse = sink for a row that saw no key.
  template <typename out_t>
  __device__ acc_t finish(int i, out_t* out_row, int64_t head_dim_v, int lane,
                          acc_t sink = -INFINITY) const {
    const RowFinish<acc_t> row = finish_row(row_max[i], row_sum[i], sink);
#pragma unroll
    for (int c = 0; c < kDimChunks; ++c) {
      const int64_t d = lane + c * kWarpSize;
      if (d < head_dim_v) store_as(out_row + d, acc[i][c] * row.out_factor);
    }
    return row.lse;
  }
};

}  // namespace mha_ext::cuda
