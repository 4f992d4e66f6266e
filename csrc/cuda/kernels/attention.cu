// Fused attention on the GPU: the launchers, and the generic SIMT kernels that take every
// dtype (fp64 included) and head dim. fp16/bf16 calls with a compiled head dim go to the
// tensor-core kernels (attention_mma.cu) instead.
//
// Every block works on one sequence's params (sequence_params): a batch entry, or one
// sequence of a packed (varlen) call, whose grid is sized by the longest sequence; blocks
// past their sequence's rows return at once.
// Forward: one block per (16 query rows, head, sequence), key tiles of 32 streamed through
// shared memory with an online softmax (simt_rows.cuh).
// Backward (FlashAttention-2): delta = rowsum(dO * O) - dlse first; then one block per
// (32 keys, kv head, sequence) walks the query rows that see its keys, for every query head
// of its GQA group, keeping dK and dV in registers and adding dQ into an fp32 workspace with
// atomics; a last pass scales dQ and casts it. A deterministic backward instead computes dQ
// in a pass of its own (attention_grad_q_simt, or attention_grad_q_mma on the tensor cores),
// one block per query rows, in a fixed order.
#include <algorithm>

#include "cuda/kernels/launch_helpers.h"
#include "cuda/kernels/launchers.h"
#include "cuda/kernels/simt_rows.cuh"
#include "cuda/kernels/tensor_core.h"

namespace mha_ext::cuda {
namespace {

// Copies rows [first, first + count) of a [rows, dim] matrix (row stride `ld_src`) into a
// shared tile of `tile_rows` rows (row stride `ld_dst`) in acc_t, times `factor`; tile rows
// past `count` are zero, so they add nothing to dot products and sums.
template <typename scalar_t, typename acc_t>
__device__ void load_tile(acc_t* tile, int64_t ld_dst, int tile_rows, const scalar_t* src,
                          int64_t ld_src, int64_t count, int64_t dim, acc_t factor) {
  for (int64_t idx = threadIdx.x; idx < tile_rows * dim; idx += blockDim.x) {
    const int64_t r = idx / dim, d = idx % dim;
    tile[r * ld_dst + d] =
        r < count ? static_cast<acc_t>(widen(src[r * ld_src + d])) * factor : acc_t(0);
  }
}

template <typename scalar_t, int kDimChunks>
__global__ void __launch_bounds__(kSimtThreads)
    attention_forward_simt(AttentionForwardParams call, const int64_t* seed) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  // The block's sequence as a batch-1 call; a packed call's grid covers its longest one.
  AttentionForwardParams p = sequence_params(call, blockIdx.z);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kSimtRows;
  if (row0 >= p.seq_q) return;
  const SimtTiles tiles{p.head_dim, p.head_dim_v};
  acc_t* q_tile = reinterpret_cast<acc_t*>(shared_bytes);  // [kSimtRows, head_dim]
  acc_t* k_tile = q_tile + kSimtRows * p.head_dim;         // [kSimtKeys, head_dim + 1]
  acc_t* v_tile = k_tile + kSimtKeys * tiles.k_ld();       // [kSimtKeys, head_dim_v]

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t head = blockIdx.y;
  const int64_t rows = min(static_cast<int64_t>(kSimtRows), p.seq_q - row0);
  const int64_t kv_head = head / (p.num_heads / p.num_kv_heads);
  if (p.dropout.enabled) p.dropout.seed = static_cast<uint64_t>(*seed);
  const HeadScoreMods<acc_t> mods = HeadScoreMods<acc_t>::of(p, head);

  const scalar_t* q =
      static_cast<const scalar_t*>(p.q) + head * p.q_strides.head + row0 * p.q_strides.row;
  const scalar_t* k = static_cast<const scalar_t*>(p.k) + kv_head * p.k_strides.head;
  const scalar_t* v = static_cast<const scalar_t*>(p.v) + kv_head * p.v_strides.head;
  load_tile(q_tile, p.head_dim, kSimtRows, q, p.q_strides.row, rows, p.head_dim,
            static_cast<acc_t>(p.scale));

  SimtRows<acc_t, kDimChunks> state;
  state.init();
  const int first_row = warp * kSimtRowsPerWarp;  // of the block's rows
  // Both window bounds grow with the row: the block's keys run from its first row's begin
  // to its last row's end.
  const int64_t key_begin = visible_keys(p.window, row0, p.seq_k).begin;
  const int64_t key_end = visible_keys(p.window, row0 + rows - 1, p.seq_k).end;
  for (int64_t key0 = key_begin; key0 < key_end; key0 += kSimtKeys) {
    const int64_t keys = min(static_cast<int64_t>(kSimtKeys), p.seq_k - key0);
    __syncthreads();  // the previous tile is no longer read (and q_tile is complete)
    load_tile(k_tile, tiles.k_ld(), kSimtKeys, k + key0 * p.k_strides.row, p.k_strides.row, keys,
              p.head_dim, acc_t(1));
    load_tile(v_tile, p.head_dim_v, kSimtKeys, v + key0 * p.v_strides.row, p.v_strides.row, keys,
              p.head_dim_v, acc_t(1));
    __syncthreads();

    acc_t scores[kSimtRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kSimtRowsPerWarp; ++i) {
      const int64_t row = row0 + first_row + i, key = key0 + lane;
      scores[i] = -INFINITY;
      if (row < p.seq_q && lane < keys) {
        const acc_t dot = row_key_dot(q_tile + (first_row + i) * p.head_dim, k_tile, tiles.k_ld(),
                                      lane, p.head_dim);
        scores[i] = masked_score<scalar_t>(mods.apply(dot, row, key), p, head, row, key);
      }
    }
    state.softmax_step(scores);
    // Dropout acts on the probabilities after their sum was taken.
    if (p.dropout.enabled) {
#pragma unroll
      for (int i = 0; i < kSimtRowsPerWarp; ++i) {
        scores[i] = apply_dropout(scores[i], p.dropout, head, row0 + first_row + i, key0 + lane);
      }
    }
    state.accumulate(scores, v_tile, p.head_dim_v, lane);
  }

  acc_t* lse = static_cast<acc_t*>(p.lse) + head * p.lse_head_stride;
  scalar_t* out = static_cast<scalar_t*>(p.out) + head * p.out_strides.head;
  const acc_t sink = sink_logit<acc_t>(p.sinks, head);
#pragma unroll
  for (int i = 0; i < kSimtRowsPerWarp; ++i) {
    const int64_t row = row0 + first_row + i;
    if (row >= p.seq_q) continue;
    const acc_t row_lse = state.finish(i, out + row * p.out_strides.row, p.head_dim_v, lane, sink);
    if (lane == 0) lse[row] = row_lse;
  }
}

// The rows of the per-row arrays (lse, delta, grad_lse, the dQ partial sums) as [batch, heads,
// rows], row i of (b, h) at lse_offset(p, b, h) + i: a dense call's seq_q rows per batch
// entry, or a packed call's total_q rows as one batch entry (q, out and the gradients have
// batch stride 0 there, so the same row index reaches their rows).
struct LseRows {
  int64_t batch;
  int64_t rows;
};

__host__ __device__ inline LseRows lse_rows_of(const AttentionForwardParams& p) {
  if (p.varlen.cu_seqlens_q != nullptr) return {1, p.lse_head_stride};
  return {p.batch, p.seq_q};
}

// delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] - dlse[b, h, i], one warp per row.
template <typename scalar_t>
__global__ void attention_delta(AttentionBackwardParams p) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  const LseRows layout = lse_rows_of(p);
  const int64_t row_index =
      (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row_index >= layout.batch * p.num_heads * layout.rows) return;  // the whole warp
  const int64_t batch = row_index / (p.num_heads * layout.rows);
  const int64_t head = row_index / layout.rows % p.num_heads;
  const int64_t row = row_index % layout.rows;
  const scalar_t* out = static_cast<const scalar_t*>(p.out) + batch * p.out_strides.batch +
                        head * p.out_strides.head + row * p.out_strides.row;
  const scalar_t* grad_out = static_cast<const scalar_t*>(p.grad_out) +
                             batch * p.grad_out_strides.batch + head * p.grad_out_strides.head +
                             row * p.grad_out_strides.row;
  acc_t dot = 0;
  for (int64_t d = lane; d < p.head_dim_v; d += kWarpSize) {
    dot += static_cast<acc_t>(widen(out[d])) * static_cast<acc_t>(widen(grad_out[d]));
  }
  dot = warp_sum(dot);
  if (lane == 0) {
    const int64_t element = lse_offset(p, batch, head) + row;
    const acc_t grad_lse = p.grad_lse ? static_cast<const acc_t*>(p.grad_lse)[element] : acc_t(0);
    static_cast<acc_t*>(p.delta)[element] = dot - grad_lse;
  }
}

// Backward shared memory, in acc_t elements.
struct SimtBackwardTiles {
  int64_t head_dim;
  int64_t head_dim_v;
  __host__ __device__ int64_t k_ld() const { return head_dim + 1; }
  __host__ __device__ int64_t v_ld() const { return head_dim_v + 1; }
  __host__ __device__ int64_t elements() const {
    return kSimtKeys * (k_ld() + v_ld()) + kSimtRows * (head_dim + head_dim_v) +
           2 * kSimtRows * (kSimtKeys + 1) + 2 * kSimtRows;
  }
};

// Keys of a backward block per warp, for the dK/dV accumulation.
constexpr int kKeysPerWarp = kSimtKeys / kSimtWarps;

// dS of one (row, key) of a sequence's params from the scaled score `dot` (scale q . k):
// P = exp(score - lse) and dS = P * (dP - delta) times the softcap's derivative, dP already
// dropped. Returns P through `prob`; both are 0 where the key is hidden.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t score_gradient(acc_t dot, acc_t grad_prob, acc_t row_lse,
                                                acc_t row_delta, const AttentionForwardParams& p,
                                                const HeadScoreMods<acc_t>& mods, int64_t head,
                                                int64_t row, int64_t key, acc_t& prob) {
  const acc_t capped = mods.capped(dot);
  const acc_t score = masked_score<scalar_t>(capped + mods.bias(row, key), p, head, row, key);
  prob = exp_of(score - row_lse);
  return prob * (grad_prob - row_delta) * mods.cap_derivative(capped);
}

template <typename scalar_t, int kDimChunks>
__global__ void __launch_bounds__(kSimtThreads)
    attention_backward_simt(AttentionBackwardParams call, const int64_t* seed) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  constexpr int kProbLd = kSimtKeys + 1;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  AttentionBackwardParams p = sequence_params(call, blockIdx.z);
  const int64_t key0 = static_cast<int64_t>(blockIdx.x) * kSimtKeys;
  if (key0 >= p.seq_k) return;  // past the block's sequence's keys
  const SimtBackwardTiles tiles{p.head_dim, p.head_dim_v};
  acc_t* k_tile = reinterpret_cast<acc_t*>(shared_bytes);  // [kSimtKeys, head_dim + 1]
  acc_t* v_tile = k_tile + kSimtKeys * tiles.k_ld();       // [kSimtKeys, head_dim_v + 1]
  acc_t* q_tile = v_tile + kSimtKeys * tiles.v_ld();       // [kSimtRows, head_dim], scaled
  acc_t* do_tile = q_tile + kSimtRows * p.head_dim;        // [kSimtRows, head_dim_v]
  acc_t* pd_tile = do_tile + kSimtRows * p.head_dim_v;     // [kSimtRows, kProbLd] P after dropout
  acc_t* ds_tile = pd_tile + kSimtRows * kProbLd;          // [kSimtRows, kProbLd] dS
  acc_t* lse_rows = ds_tile + kSimtRows * kProbLd;         // [kSimtRows]
  acc_t* delta_rows = lse_rows + kSimtRows;                // [kSimtRows]

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t kv_head = blockIdx.y;
  const int64_t keys = min(static_cast<int64_t>(kSimtKeys), p.seq_k - key0);
  const int64_t group = p.num_heads / p.num_kv_heads;
  const acc_t scale = static_cast<acc_t>(p.scale);
  if (p.dropout.enabled) p.dropout.seed = static_cast<uint64_t>(*seed);

  load_tile(k_tile, tiles.k_ld(), kSimtKeys,
            static_cast<const scalar_t*>(p.k) + kv_head * p.k_strides.head + key0 * p.k_strides.row,
            p.k_strides.row, keys, p.head_dim, acc_t(1));
  load_tile(v_tile, tiles.v_ld(), kSimtKeys,
            static_cast<const scalar_t*>(p.v) + kv_head * p.v_strides.head + key0 * p.v_strides.row,
            p.v_strides.row, keys, p.head_dim_v, acc_t(1));

  // Warp w accumulates dK/dV of keys key0 + w * kKeysPerWarp + j, lane l dims l, l + 32, ...
  acc_t grad_k[kKeysPerWarp][kDimChunks] = {};
  acc_t grad_v[kKeysPerWarp][kDimChunks] = {};
  const KeyRange seeing = rows_seeing_keys(p.window, key0, key0 + keys, p.seq_q);
  const int first_row = warp * kSimtRowsPerWarp;

  for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
    const HeadScoreMods<acc_t> mods = HeadScoreMods<acc_t>::of(p, head);
    const acc_t* lse = static_cast<const acc_t*>(p.lse) + head * p.lse_head_stride;
    const acc_t* delta = static_cast<const acc_t*>(p.delta) + head * p.lse_head_stride;
    for (int64_t row0 = seeing.begin; row0 < seeing.end; row0 += kSimtRows) {
      const int64_t rows = min(static_cast<int64_t>(kSimtRows), seeing.end - row0);
      __syncthreads();  // the previous rows' tiles are no longer read
      // Scaled on load: S = (scale Q) K^T, and dK = dS^T (scale Q) needs no rescaling.
      load_tile(
          q_tile, p.head_dim, kSimtRows,
          static_cast<const scalar_t*>(p.q) + head * p.q_strides.head + row0 * p.q_strides.row,
          p.q_strides.row, rows, p.head_dim, scale);
      load_tile(do_tile, p.head_dim_v, kSimtRows,
                static_cast<const scalar_t*>(p.grad_out) + head * p.grad_out_strides.head +
                    row0 * p.grad_out_strides.row,
                p.grad_out_strides.row, rows, p.head_dim_v, acc_t(1));
      if (threadIdx.x < kSimtRows) {
        const bool valid = threadIdx.x < rows;
        lse_rows[threadIdx.x] = valid ? lse[row0 + threadIdx.x] : acc_t(-INFINITY);
        delta_rows[threadIdx.x] = valid ? delta[row0 + threadIdx.x] : acc_t(0);
      }
      __syncthreads();

      // P = exp(S - lse) and dS = P * (dP * dropout - delta), lane = key. Rolled, as is the dQ
      // loop below: unrolled, the fp32 kernel of kDimChunks 2 spilled 108 bytes a thread
      // (nvcc 13, sm_90, -Xptxas -v); rolled, none.
#pragma unroll 1
      for (int i = 0; i < kSimtRowsPerWarp; ++i) {
        const int r = first_row + i;
        const int64_t row = row0 + r, key = key0 + lane;
        acc_t prob_dropped = 0, grad_score = 0;
        // A row past the tile (lse -inf) has P = 0.
        if (lane < keys && lse_rows[r] != acc_t(-INFINITY)) {
          acc_t grad_prob =
              row_key_dot(do_tile + r * p.head_dim_v, v_tile, tiles.v_ld(), lane, p.head_dim_v);
          if (p.dropout.enabled) grad_prob = apply_dropout(grad_prob, p.dropout, head, row, key);
          acc_t prob;
          grad_score = score_gradient<scalar_t>(
              row_key_dot(q_tile + r * p.head_dim, k_tile, tiles.k_ld(), lane, p.head_dim),
              grad_prob, lse_rows[r], delta_rows[r], p, mods, head, row, key, prob);
          prob_dropped = p.dropout.enabled ? apply_dropout(prob, p.dropout, head, row, key) : prob;
        }
        pd_tile[r * kProbLd + lane] = prob_dropped;
        ds_tile[r * kProbLd + lane] = grad_score;
      }
      __syncthreads();

      // dV += P_dropped^T dO and dK += dS^T (scale Q) for the warp's keys.
#pragma unroll
      for (int j = 0; j < kKeysPerWarp; ++j) {
        const int key = warp * kKeysPerWarp + j;
        for (int r = 0; r < kSimtRows; ++r) {
          const acc_t prob = pd_tile[r * kProbLd + key];
          const acc_t grad_score = ds_tile[r * kProbLd + key];
#pragma unroll
          for (int c = 0; c < kDimChunks; ++c) {
            const int64_t d = lane + c * kWarpSize;
            if (d < p.head_dim_v) grad_v[j][c] += prob * do_tile[r * p.head_dim_v + d];
            if (d < p.head_dim) grad_k[j][c] += grad_score * q_tile[r * p.head_dim + d];
          }
        }
      }
      // A deterministic backward leaves dQ to its own pass (attention_grad_q_simt).
      if (p.deterministic) continue;
      // dQ += dS K for the warp's rows (scaled when dQ is cast, after all key blocks added).
      acc_t* grad_q_accum =
          static_cast<acc_t*>(p.grad_q_accum) + head * p.lse_head_stride * p.head_dim;
#pragma unroll 1
      for (int i = 0; i < kSimtRowsPerWarp; ++i) {
        const int r = first_row + i;
        if (r >= rows) continue;
#pragma unroll
        for (int c = 0; c < kDimChunks; ++c) {
          const int64_t d = lane + c * kWarpSize;
          if (d >= p.head_dim) continue;
          acc_t sum = 0;
          for (int key = 0; key < keys; ++key)
            sum += ds_tile[r * kProbLd + key] * k_tile[key * tiles.k_ld() + d];
          atomicAdd(grad_q_accum + (row0 + r) * p.head_dim + d, sum);
        }
      }
    }
  }

  scalar_t* grad_k_out = static_cast<scalar_t*>(p.grad_k) + kv_head * p.grad_k_strides.head;
  scalar_t* grad_v_out = static_cast<scalar_t*>(p.grad_v) + kv_head * p.grad_v_strides.head;
#pragma unroll
  for (int j = 0; j < kKeysPerWarp; ++j) {
    const int64_t key = key0 + warp * kKeysPerWarp + j;
    if (key >= p.seq_k) continue;
#pragma unroll
    for (int c = 0; c < kDimChunks; ++c) {
      const int64_t d = lane + c * kWarpSize;
      if (d < p.head_dim) store_as(grad_k_out + key * p.grad_k_strides.row + d, grad_k[j][c]);
      if (d < p.head_dim_v) store_as(grad_v_out + key * p.grad_v_strides.row + d, grad_v[j][c]);
    }
  }
}

// Shared memory of the dQ pass, in acc_t elements: q_tile [kSimtRows, head_dim] (scaled),
// do_tile [kSimtRows, head_dim_v], k_tile [kSimtKeys, head_dim + 1], v_tile [kSimtKeys,
// head_dim_v + 1].
struct SimtGradQTiles {
  int64_t head_dim;
  int64_t head_dim_v;
  __host__ __device__ int64_t k_ld() const { return head_dim + 1; }
  __host__ __device__ int64_t v_ld() const { return head_dim_v + 1; }
  __host__ __device__ int64_t elements() const {
    return kSimtRows * (head_dim + head_dim_v) + kSimtKeys * (k_ld() + v_ld());
  }
};

// The deterministic backward's dQ: one block per (16 query rows, head, sequence) walks its
// keys in order, as the forward does, recomputes dS and keeps dQ = scale * dS K in registers,
// so no two blocks add into one row and the sum has one order. attention_grad_q_mma is its
// tensor-core version.
template <typename scalar_t, int kDimChunks>
__global__ void __launch_bounds__(kSimtThreads)
    attention_grad_q_simt(AttentionBackwardParams call, const int64_t* seed) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  AttentionBackwardParams p = sequence_params(call, blockIdx.z);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kSimtRows;
  if (row0 >= p.seq_q) return;
  const SimtGradQTiles tiles{p.head_dim, p.head_dim_v};
  acc_t* q_tile = reinterpret_cast<acc_t*>(shared_bytes);  // [kSimtRows, head_dim], scaled
  acc_t* do_tile = q_tile + kSimtRows * p.head_dim;        // [kSimtRows, head_dim_v]
  acc_t* k_tile = do_tile + kSimtRows * p.head_dim_v;      // [kSimtKeys, head_dim + 1]
  acc_t* v_tile = k_tile + kSimtKeys * tiles.k_ld();       // [kSimtKeys, head_dim_v + 1]

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t head = blockIdx.y;
  const int64_t rows = min(static_cast<int64_t>(kSimtRows), p.seq_q - row0);
  const int64_t kv_head = head / (p.num_heads / p.num_kv_heads);
  if (p.dropout.enabled) p.dropout.seed = static_cast<uint64_t>(*seed);
  const HeadScoreMods<acc_t> mods = HeadScoreMods<acc_t>::of(p, head);
  const scalar_t* k = static_cast<const scalar_t*>(p.k) + kv_head * p.k_strides.head;
  const scalar_t* v = static_cast<const scalar_t*>(p.v) + kv_head * p.v_strides.head;
  load_tile(q_tile, p.head_dim, kSimtRows,
            static_cast<const scalar_t*>(p.q) + head * p.q_strides.head + row0 * p.q_strides.row,
            p.q_strides.row, rows, p.head_dim, static_cast<acc_t>(p.scale));
  load_tile(do_tile, p.head_dim_v, kSimtRows,
            static_cast<const scalar_t*>(p.grad_out) + head * p.grad_out_strides.head +
                row0 * p.grad_out_strides.row,
            p.grad_out_strides.row, rows, p.head_dim_v, acc_t(1));

  const int first_row = warp * kSimtRowsPerWarp;
  acc_t row_lse[kSimtRowsPerWarp], row_delta[kSimtRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kSimtRowsPerWarp; ++i) {
    const int64_t row = row0 + first_row + i;
    const int64_t element = head * p.lse_head_stride + row;
    row_lse[i] = row < p.seq_q ? static_cast<const acc_t*>(p.lse)[element] : acc_t(-INFINITY);
    row_delta[i] = row < p.seq_q ? static_cast<const acc_t*>(p.delta)[element] : acc_t(0);
  }
  acc_t grad_q[kSimtRowsPerWarp][kDimChunks] = {};
  const int64_t key_begin = visible_keys(p.window, row0, p.seq_k).begin;
  const int64_t key_end = visible_keys(p.window, row0 + rows - 1, p.seq_k).end;
  for (int64_t key0 = key_begin; key0 < key_end; key0 += kSimtKeys) {
    const int64_t keys = min(static_cast<int64_t>(kSimtKeys), p.seq_k - key0);
    __syncthreads();  // the previous tile is no longer read (and the row tiles are complete)
    load_tile(k_tile, tiles.k_ld(), kSimtKeys, k + key0 * p.k_strides.row, p.k_strides.row, keys,
              p.head_dim, acc_t(1));
    load_tile(v_tile, tiles.v_ld(), kSimtKeys, v + key0 * p.v_strides.row, p.v_strides.row, keys,
              p.head_dim_v, acc_t(1));
    __syncthreads();

    // This lane's key's dS for the warp's rows, then dQ += dS K with dS broadcast per key.
    acc_t grad_scores[kSimtRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kSimtRowsPerWarp; ++i) {
      const int r = first_row + i;
      const int64_t row = row0 + r, key = key0 + lane;
      grad_scores[i] = 0;
      if (lane < keys && row_lse[i] != acc_t(-INFINITY)) {
        acc_t grad_prob =
            row_key_dot(do_tile + r * p.head_dim_v, v_tile, tiles.v_ld(), lane, p.head_dim_v);
        if (p.dropout.enabled) grad_prob = apply_dropout(grad_prob, p.dropout, head, row, key);
        acc_t prob;
        grad_scores[i] = score_gradient<scalar_t>(
            row_key_dot(q_tile + r * p.head_dim, k_tile, tiles.k_ld(), lane, p.head_dim), grad_prob,
            row_lse[i], row_delta[i], p, mods, head, row, key, prob);
      }
    }
    for (int key = 0; key < kSimtKeys; ++key) {
      const acc_t* k_row = k_tile + key * tiles.k_ld();
#pragma unroll
      for (int i = 0; i < kSimtRowsPerWarp; ++i) {
        const acc_t grad_score = __shfl_sync(kFullMask, grad_scores[i], key);
#pragma unroll
        for (int c = 0; c < kDimChunks; ++c) {
          const int64_t d = lane + c * kWarpSize;
          if (d < p.head_dim) grad_q[i][c] += grad_score * k_row[d];
        }
      }
    }
  }

  scalar_t* grad_q_out = static_cast<scalar_t*>(p.grad_q) + head * p.grad_q_strides.head;
  const acc_t scale = static_cast<acc_t>(p.scale);
#pragma unroll
  for (int i = 0; i < kSimtRowsPerWarp; ++i) {
    const int64_t row = row0 + first_row + i;
    if (row >= p.seq_q) continue;
#pragma unroll
    for (int c = 0; c < kDimChunks; ++c) {
      const int64_t d = lane + c * kWarpSize;
      if (d < p.head_dim)
        store_as(grad_q_out + row * p.grad_q_strides.row + d, scale * grad_q[i][c]);
    }
  }
}

// grad_q = scale * (the sum of the num_kv_splits partial sums, in split order), cast to the
// input dtype.
template <typename scalar_t>
__global__ void attention_grad_q_cast(AttentionBackwardParams p) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  const LseRows layout = lse_rows_of(p);
  const int64_t total = layout.batch * p.num_heads * layout.rows * p.head_dim;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const acc_t* accum = static_cast<const acc_t*>(p.grad_q_accum);
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t d = idx % p.head_dim, row = idx / p.head_dim % layout.rows;
    const int64_t head = idx / (p.head_dim * layout.rows) % p.num_heads,
                  batch = idx / (p.head_dim * layout.rows * p.num_heads);
    const int64_t element = (lse_offset(p, batch, head) + row) * p.head_dim + d;
    acc_t sum = accum[element];
    for (int64_t split = 1; split < p.num_kv_splits; ++split) {
      sum += accum[split * p.grad_q_accum_split_stride + element];
    }
    store_as(static_cast<scalar_t*>(p.grad_q) + batch * p.grad_q_strides.batch +
                 head * p.grad_q_strides.head + row * p.grad_q_strides.row + d,
             static_cast<acc_t>(p.scale) * sum);
  }
}

// Launches kernel<<<grid, threads, shared>>>, opting into more than 48 KiB of shared memory
// when the tiles need it.
template <typename Kernel, typename... Args>
cudaError_t launch_with_shared(Kernel kernel, dim3 grid, int threads, size_t shared_bytes,
                               cudaStream_t stream, Args... args) {
  if (shared_bytes > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
    if (status != cudaSuccess) return status;
  }
  kernel<<<grid, threads, shared_bytes, stream>>>(args...);
  return cudaGetLastError();
}

// Launches the SIMT kernel kernel_of(scalar_t{}, kDimChunks) for p's dtype and head dims over
// `grid`, with shared memory for `tiles` (a *Tiles struct).
template <typename Params, typename Tiles, typename KernelOf>
cudaError_t launch_simt(const Params& p, const int64_t* seed, dim3 grid, Tiles tiles,
                        cudaStream_t stream, KernelOf kernel_of) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using acc_t = typename AccumulateType<decltype(tag)>::type;
    cudaError_t status = cudaSuccess;
    dispatch_dim_chunks(std::max(p.head_dim, p.head_dim_v), [&](auto chunks) {
      status = launch_with_shared(kernel_of(tag, chunks), grid, kSimtThreads,
                                  tiles.elements() * sizeof(acc_t), stream, p, seed);
      return true;
    });
    return status;
  });
}

// Blocks of 16 query rows per (head, sequence): the forward and the dQ pass.
dim3 query_grid(const AttentionForwardParams& p) {
  return dim3(static_cast<unsigned>(ceil_div<int64_t>(p.seq_q, kSimtRows)),
              static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch));
}

cudaError_t forward_simt(const AttentionForwardParams& p, const int64_t* seed,
                         cudaStream_t stream) {
  return launch_simt(p, seed, query_grid(p), SimtTiles{p.head_dim, p.head_dim_v}, stream,
                     [](auto tag, auto chunks) {
                       return attention_forward_simt<decltype(tag), decltype(chunks)::value>;
                     });
}

cudaError_t backward_simt(const AttentionBackwardParams& p, const int64_t* seed,
                          cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(p.seq_k, kSimtKeys)),
                  static_cast<unsigned>(p.num_kv_heads), static_cast<unsigned>(p.batch));
  return launch_simt(p, seed, grid, SimtBackwardTiles{p.head_dim, p.head_dim_v}, stream,
                     [](auto tag, auto chunks) {
                       return attention_backward_simt<decltype(tag), decltype(chunks)::value>;
                     });
}

cudaError_t grad_q_simt(const AttentionBackwardParams& p, const int64_t* seed,
                        cudaStream_t stream) {
  return launch_simt(p, seed, query_grid(p), SimtGradQTiles{p.head_dim, p.head_dim_v}, stream,
                     [](auto tag, auto chunks) {
                       return attention_grad_q_simt<decltype(tag), decltype(chunks)::value>;
                     });
}

cudaError_t delta_and_grad_q_cast(const AttentionBackwardParams& p, cudaStream_t stream,
                                  bool delta) {
  const LseRows layout = lse_rows_of(p);
  const int64_t rows = layout.batch * p.num_heads * layout.rows;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    constexpr int kThreads = 256;
    if (delta) {
      attention_delta<scalar_t>
          <<<static_cast<unsigned>(ceil_div<int64_t>(rows * kWarpSize, kThreads)), kThreads, 0,
             stream>>>(p);
    } else {
      attention_grad_q_cast<scalar_t>
          <<<stride_blocks(rows * p.head_dim, kThreads), kThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t launch_attention_forward(const AttentionForwardParams& p, const int64_t* seed,
                                     KernelChoice choice, cudaStream_t stream) {
  if (p.batch == 0 || p.num_heads == 0 || p.seq_q == 0) return cudaSuccess;
  if (choice.allow_tensor_cores && tensor_core_forward(p, seed, stream)) return cudaGetLastError();
  return forward_simt(p, seed, stream);
}

cudaError_t launch_attention_backward(const AttentionBackwardParams& p, const int64_t* seed,
                                      KernelChoice choice, cudaStream_t stream) {
  if (p.batch == 0 || p.num_heads == 0) return cudaSuccess;
  const bool has_rows = p.seq_q > 0 && lse_rows_of(p).rows > 0;
  if (has_rows) {
    const cudaError_t status = delta_and_grad_q_cast(p, stream, /*delta=*/true);
    if (status != cudaSuccess) return status;
  }
  // Every key block runs, also with no query rows: it writes its (zero) dK and dV.
  if (p.seq_k > 0) {
    const bool done = choice.allow_tensor_cores && tensor_core_backward(p, seed, stream);
    const cudaError_t status = done ? cudaGetLastError() : backward_simt(p, seed, stream);
    if (status != cudaSuccess) return status;
  }
  if (!has_rows) return cudaSuccess;
  // Deterministic: dQ from its own pass, written once per row; else the atomics' sums, cast.
  if (!p.deterministic) return delta_and_grad_q_cast(p, stream, /*delta=*/false);
  const bool done = choice.allow_tensor_cores && tensor_core_grad_q(p, seed, stream);
  return done ? cudaGetLastError() : grad_q_simt(p, seed, stream);
}

}  // namespace mha_ext::cuda
