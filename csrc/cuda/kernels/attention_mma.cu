// Tensor-core attention forward for fp16 and bf16 (FlashAttention-2 schedule, sm_80+):
// a block of 4 warps owns 64 query rows of one head (16 per warp, kept as MMA fragments in
// registers); key tiles of 64 keys and their values are staged in shared memory; S = Q K^T
// and O += P V run on mma.sync.m16n8k16 with fp32 accumulation, and the online softmax
// works on the S fragments in registers, so P never leaves the warp.
//
// Fragment layout of mma.m16n8k16 (PTX ISA), lane = 4 * g + t:
//   A (16x16, row major): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 =
//   A[g+8][2t+8..] B (16x8, k x n):      b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g] C (16x8, fp32):
//   c0, c1 = C[g][2t], C[g][2t+1]; c2, c3 = C[g+8][2t], C[g+8][2t+1]
// Two adjacent n-tiles of a C fragment (keys 0-7 and 8-15) are exactly the A fragment of the
// next product, which is how P feeds P V without a trip through shared memory.
#include <cstring>
#include <type_traits>
#include <utility>

#include "cuda/kernels/common.cuh"
#include "cuda/kernels/tensor_core.h"

// Head dims with a tensor-core kernel: bit i set compiles head dim 16 * (i + 1). The build
// derives the mask from MHA_EXT_HEAD_DIMS (a list would not survive nvcc's -D, which splits
// values at commas); the default 136 is head dims 64 and 128. Others run the generic kernels.
#ifndef MHA_EXT_HEAD_DIM_MASK
#define MHA_EXT_HEAD_DIM_MASK 136
#endif

namespace mha_ext::cuda {
namespace {

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * kWarpSize;
constexpr int kMmaRows = 16 * kMmaWarps;  // query rows per block
constexpr int kMmaKeys = 64;              // keys per tile
constexpr int kFragmentsPerTile = kMmaKeys / 8;

// Two 16-bit values in one 32-bit register, `low` in the low half (the lower index).
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(T low, T high) {
  uint16_t low_bits, high_bits;
  memcpy(&low_bits, &low, sizeof(low_bits));
  memcpy(&high_bits, &high, sizeof(high_bits));
  return static_cast<uint32_t>(low_bits) | (static_cast<uint32_t>(high_bits) << 16);
}

__device__ __forceinline__ uint32_t pack_floats(float low, float high, __half) {
  const __half2 pair = __floats2half2_rn(low, high);
  uint32_t bits;
  memcpy(&bits, &pair, sizeof(bits));
  return bits;
}

__device__ __forceinline__ uint32_t pack_floats(float low, float high, __nv_bfloat16) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  uint32_t bits;
  memcpy(&bits, &pair, sizeof(bits));
  return bits;
}

// Two consecutive 16-bit elements (the first at an even index) as one register.
template <typename T>
__device__ __forceinline__ uint32_t load_pair(const T* pair) {
  return *reinterpret_cast<const uint32_t*>(pair);
}

// c += a * b on the tensor cores, fp32 accumulation.
__device__ __forceinline__ void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2], __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2], __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Shared tiles hold kDim + 8 elements per row: rows then start 16 bytes apart modulo 128,
// so the 8 rows (g) x 4 pairs (t) a fragment load touches fall on 32 different banks.
template <int kDim>
constexpr int kTileLd = kDim + 8;

// Copies rows [first, first + tile_rows) of a [count, kDim] matrix into a shared tile in
// 16-byte pieces; rows at or past `count` are zero (finite: 0 * P adds nothing).
template <typename T, int kDim>
__device__ __forceinline__ void load_tile(T* tile, int tile_rows, const T* src, int64_t ld_src,
                                          int64_t first, int64_t count) {
  constexpr int kPiecesPerRow = kDim * sizeof(T) / sizeof(uint4);
  for (int idx = threadIdx.x; idx < tile_rows * kPiecesPerRow; idx += kMmaThreads) {
    const int r = idx / kPiecesPerRow, piece = idx % kPiecesPerRow;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (first + r < count) {
      value = *reinterpret_cast<const uint4*>(src + (first + r) * ld_src + piece * 8);
    }
    *reinterpret_cast<uint4*>(tile + r * kTileLd<kDim> + piece * 8) = value;
  }
}

// A fragments of 16 rows x kDim of a staged tile, one per k-step of 16 dims: `rows` points at
// element (g, 2t) of the 16 rows.
template <typename T, int kDim>
__device__ __forceinline__ void load_a_fragments(uint32_t (&frag)[kDim / 16][4], const T* rows) {
  constexpr int kLd = kTileLd<kDim>;
#pragma unroll
  for (int step = 0; step < kDim / 16; ++step) {
    frag[step][0] = load_pair(rows + step * 16);
    frag[step][1] = load_pair(rows + 8 * kLd + step * 16);
    frag[step][2] = load_pair(rows + step * 16 + 8);
    frag[step][3] = load_pair(rows + 8 * kLd + step * 16 + 8);
  }
}

// acc += S B for a 16-row tile of scores S held as this thread's C fragments s (fp32, rounded
// to T here, so that S's C fragments serve as A fragments) and B [kMmaKeys, kDim] the rows of
// a staged tile, two rows per register: `rows` points at element (2t, g) of the tile. O += P V
// in the forward, dQ += dS K in the deterministic dQ pass.
template <typename T, int kDim>
__device__ __forceinline__ void mma_scores_by_tile(float (&acc)[kDim / 8][4],
                                                   const float (&s)[kFragmentsPerTile][4],
                                                   const T* rows) {
  constexpr int kLd = kTileLd<kDim>;
#pragma unroll
  for (int step = 0; step < kMmaKeys / 16; ++step) {
    const uint32_t a[4] = {pack_floats(s[2 * step][0], s[2 * step][1], T{}),
                           pack_floats(s[2 * step][2], s[2 * step][3], T{}),
                           pack_floats(s[2 * step + 1][0], s[2 * step + 1][1], T{}),
                           pack_floats(s[2 * step + 1][2], s[2 * step + 1][3], T{})};
    const T* step_rows = rows + step * 16 * kLd;
#pragma unroll
    for (int f = 0; f < kDim / 8; ++f) {
      const T* col = step_rows + f * 8;
      const uint32_t b[2] = {pack_pair(col[0], col[kLd]), pack_pair(col[8 * kLd], col[9 * kLd])};
      mma_16x8x16(acc[f], a, b, T{});
    }
  }
}

template <typename T, int kDim>
__global__ void __launch_bounds__(kMmaThreads)
    attention_forward_mma(AttentionForwardParams call, const int64_t* seed) {
  static_assert(kDim % 16 == 0 && kDim <= 256,
                "tensor-core head dims are multiples of 16 up to 256");
  constexpr int kLd = kTileLd<kDim>;
  constexpr int kDimSteps = kDim / 16;     // k-steps of S = Q K^T
  constexpr int kDimFragments = kDim / 8;  // n-tiles of O
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  // The block's sequence as a batch-1 call; a packed call's grid covers its longest one.
  AttentionForwardParams p = sequence_params(call, blockIdx.z);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kMmaRows;
  if (row0 >= p.seq_q) return;
  T* k_tile = reinterpret_cast<T*>(shared_bytes);  // [kMmaKeys, kLd]; first stages Q
  T* v_tile = k_tile + kMmaKeys * kLd;             // [kMmaKeys, kLd]

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int64_t head = blockIdx.y;
  const int64_t kv_head = head / (p.num_heads / p.num_kv_heads);
  if (p.dropout.enabled) p.dropout.seed = static_cast<uint64_t>(*seed);
  const HeadScoreMods<float> mods = HeadScoreMods<float>::of(p, head);
  const bool modified = mods.active();
  const T* q = static_cast<const T*>(p.q) + head * p.q_strides.head;
  const T* k = static_cast<const T*>(p.k) + kv_head * p.k_strides.head;
  const T* v = static_cast<const T*>(p.v) + kv_head * p.v_strides.head;

  // Q fragments of the warp's 16 rows, staged through the K tile.
  load_tile<T, kDim>(k_tile, kMmaRows, q, p.q_strides.row, row0, p.seq_q);
  __syncthreads();
  uint32_t q_frag[kDimSteps][4];
  load_a_fragments<T, kDim>(q_frag, k_tile + (warp * 16 + g) * kLd + 2 * t);

  // This thread's two rows: r = 0 is row g of the warp's 16, r = 1 row g + 8.
  const int64_t rows[2] = {row0 + warp * 16 + g, row0 + warp * 16 + g + 8};
  float o_acc[kDimFragments][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};  // this thread's share; the quad adds up at the end
  const float scale = static_cast<float>(p.scale);

  // Tiles start at multiples of kMmaKeys, so the pair of keys a thread holds (an even key
  // and the next) always shares one group of 4 Philox words.
  const int64_t last_row = min(row0 + kMmaRows, p.seq_q) - 1;
  const int64_t key_begin = visible_keys(p.window, row0, p.seq_k).begin / kMmaKeys * kMmaKeys;
  const int64_t key_end = visible_keys(p.window, last_row, p.seq_k).end;
  for (int64_t key0 = key_begin; key0 < key_end; key0 += kMmaKeys) {
    __syncthreads();  // the previous tile (or Q) is no longer read
    load_tile<T, kDim>(k_tile, kMmaKeys, k, p.k_strides.row, key0, p.seq_k);
    load_tile<T, kDim>(v_tile, kMmaKeys, v, p.v_strides.row, key0, p.seq_k);
    __syncthreads();

    // S = Q K^T: B[d][key] = K[key][d], so a B fragment is a pair of one K row.
    float s[kFragmentsPerTile][4] = {};
#pragma unroll
    for (int n = 0; n < kFragmentsPerTile; ++n) {
      const T* k_row = k_tile + (n * 8 + g) * kLd + 2 * t;
#pragma unroll
      for (int step = 0; step < kDimSteps; ++step) {
        const uint32_t b[2] = {load_pair(k_row + step * 16), load_pair(k_row + step * 16 + 8)};
        mma_16x8x16(s[n], q_frag[step], b, T{});
      }
    }

    // Scale, softcap and ALiBi, then the window / mask / sequence end per element where the
    // tile needs them.
    const bool whole_tile_visible = p.mask.kind == MaskKind::kNone && key0 + kMmaKeys <= p.seq_k &&
                                    visible_keys(p.window, row0, p.seq_k).end >= key0 + kMmaKeys &&
                                    visible_keys(p.window, last_row, p.seq_k).begin <= key0;
#pragma unroll
    for (int n = 0; n < kFragmentsPerTile; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t col = key0 + n * 8 + 2 * t + (e & 1);
        float score = s[n][e] * scale;
        if (modified) score = mods.apply(score, rows[e / 2], col);
        // Rows past seq_q are never stored; they must not read the mask either.
        if (!whole_tile_visible) {
          score =
              rows[e / 2] < p.seq_q ? masked_score<T>(score, p, head, rows[e / 2], col) : -INFINITY;
        }
        s[n][e] = score;
      }
    }

    // Online softmax per row; the 4 threads of a quad (same g) share a row.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < kFragmentsPerTile; ++n)
        tile_max = fmaxf(tile_max, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
      const float new_max = fmaxf(row_max[r], tile_max);
      const bool empty = new_max == -INFINITY;
      const float rescale = empty ? 1.f : __expf(row_max[r] - new_max);
      const float base = empty ? 0.f : new_max;
      row_max[r] = new_max;
      row_sum[r] *= rescale;
#pragma unroll
      for (int f = 0; f < kDimFragments; ++f) {
        o_acc[f][2 * r] *= rescale;
        o_acc[f][2 * r + 1] *= rescale;
      }
#pragma unroll
      for (int n = 0; n < kFragmentsPerTile; ++n) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          s[n][e] = __expf(s[n][e] - base);
          row_sum[r] += s[n][e];
        }
      }
    }

    // Dropout on the probabilities after their sum was taken.
    if (p.dropout.enabled) {
      const float keep_scale = static_cast<float>(p.dropout.keep_scale);
#pragma unroll
      for (int n = 0; n < kFragmentsPerTile; ++n) {
        const int64_t col = key0 + n * 8 + 2 * t;  // even: col and col + 1 share a word group
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const Philox4x32 bits = sequence_dropout_bits(p.dropout, head, rows[r], col);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const bool kept = dropout_word_kept(p.dropout, bits.word[(col & 3) + i]);
            s[n][2 * r + i] = kept ? s[n][2 * r + i] * keep_scale : 0.f;
          }
        }
      }
    }

    // O += P V: P's A fragments come from S's C fragments.
    mma_scores_by_tile<T, kDim>(o_acc, s, v_tile + 2 * t * kLd + g);
  }

  T* out = static_cast<T*>(p.out) + head * p.out_strides.head;
  float* lse = static_cast<float*>(p.lse) + head * p.lse_head_stride;
  const float sink = sink_logit<float>(p.sinks, head);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float total = row_sum[r];
    total += __shfl_xor_sync(kFullMask, total, 1);
    total += __shfl_xor_sync(kFullMask, total, 2);
    if (rows[r] >= p.seq_q) continue;
    const RowFinish<float> row = finish_row(row_max[r], total, sink);
    T* out_row = out + rows[r] * p.out_strides.row + 2 * t;
#pragma unroll
    for (int f = 0; f < kDimFragments; ++f) {
      store_as(out_row + f * 8, o_acc[f][2 * r] * row.out_factor);
      store_as(out_row + f * 8 + 1, o_acc[f][2 * r + 1] * row.out_factor);
    }
    if (t == 0) lse[rows[r]] = row.lse;
  }
}

// Backward (FlashAttention-2 schedule): a block owns 64 keys of one kv head (16 per warp)
// and walks, for every query head of its GQA group, the query rows that see them in tiles of
// 32. Per tile each warp recomputes S^T = K Q^T for its keys on the tensor cores, P^T from
// the saved logsumexp, dP^T = V dO^T and dS^T; then accumulates dV += P^T dO and
// dK += dS^T Q in registers (P^T and dS^T feed the MMAs straight from their C fragments),
// and leaves dS in shared memory for dQ = dS K, which the warps add into the fp32
// workspace with atomics (not in a deterministic backward, whose dQ has its own pass).
constexpr int kBwdKeys = 16 * kMmaWarps;  // keys per block
constexpr int kBwdRows = 32;              // query rows per tile
constexpr int kBwdFragments = kBwdRows / 8;
constexpr int kDsLd = kBwdKeys + 8;  // dS tile row stride (bank spread, as kTileLd)

template <int kDim>
constexpr size_t kBwdSharedBytes = (2 * kBwdKeys + 2 * kBwdRows) * kTileLd<kDim> * 2 +
                                   kBwdRows * kDsLd * 2 + 2 * kBwdRows * sizeof(float);

template <typename T, int kDim>
__global__ void __launch_bounds__(kMmaThreads)
    attention_backward_mma(AttentionBackwardParams call, const int64_t* seed) {
  constexpr int kLd = kTileLd<kDim>;
  constexpr int kDimSteps = kDim / 16;
  constexpr int kDimFragments = kDim / 8;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  AttentionBackwardParams p = sequence_params(call, blockIdx.z);
  const int64_t key0 = static_cast<int64_t>(blockIdx.x) * kBwdKeys;
  if (key0 >= p.seq_k) return;                     // past the block's sequence's keys
  T* k_tile = reinterpret_cast<T*>(shared_bytes);  // [kBwdKeys, kLd]
  T* v_tile = k_tile + kBwdKeys * kLd;             // [kBwdKeys, kLd]
  T* q_tile = v_tile + kBwdKeys * kLd;             // [kBwdRows, kLd]
  T* do_tile = q_tile + kBwdRows * kLd;            // [kBwdRows, kLd]
  T* ds_tile = do_tile + kBwdRows * kLd;           // [kBwdRows, kDsLd]: dS (query-major)
  float* lse_rows = reinterpret_cast<float*>(ds_tile + kBwdRows * kDsLd);  // [kBwdRows]
  float* delta_rows = lse_rows + kBwdRows;                                 // [kBwdRows]

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int64_t kv_head = blockIdx.y;
  const int64_t keys = min(static_cast<int64_t>(kBwdKeys), p.seq_k - key0);
  const int64_t group = p.num_heads / p.num_kv_heads;
  const float scale = static_cast<float>(p.scale);
  if (p.dropout.enabled) p.dropout.seed = static_cast<uint64_t>(*seed);
  const float keep_scale = static_cast<float>(p.dropout.keep_scale);

  load_tile<T, kDim>(k_tile, kBwdKeys, static_cast<const T*>(p.k) + kv_head * p.k_strides.head,
                     p.k_strides.row, key0, p.seq_k);
  load_tile<T, kDim>(v_tile, kBwdKeys, static_cast<const T*>(p.v) + kv_head * p.v_strides.head,
                     p.v_strides.row, key0, p.seq_k);

  // This thread's keys in the C fragments of S^T: r = 0 is key g of the warp's 16, r = 1 key g + 8.
  const int warp_key = warp * 16;
  const int64_t my_keys[2] = {key0 + warp_key + g, key0 + warp_key + g + 8};
  float grad_k[kDimFragments][4] = {};
  float grad_v[kDimFragments][4] = {};
  const KeyRange seeing = rows_seeing_keys(p.window, key0, key0 + keys, p.seq_q);

  for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
    const HeadScoreMods<float> mods = HeadScoreMods<float>::of(p, head);
    const float* lse = static_cast<const float*>(p.lse) + head * p.lse_head_stride;
    const float* delta = static_cast<const float*>(p.delta) + head * p.lse_head_stride;
    const T* q = static_cast<const T*>(p.q) + head * p.q_strides.head;
    const T* grad_out = static_cast<const T*>(p.grad_out) + head * p.grad_out_strides.head;
    for (int64_t row0 = seeing.begin; row0 < seeing.end; row0 += kBwdRows) {
      __syncthreads();  // the previous tile's Q, dO and dS are no longer read (K, V complete)
      load_tile<T, kDim>(q_tile, kBwdRows, q, p.q_strides.row, row0, p.seq_q);
      load_tile<T, kDim>(do_tile, kBwdRows, grad_out, p.grad_out_strides.row, row0, p.seq_q);
      if (threadIdx.x < kBwdRows) {
        const int64_t row = row0 + threadIdx.x;
        lse_rows[threadIdx.x] = row < p.seq_q ? lse[row] : -INFINITY;
        delta_rows[threadIdx.x] = row < p.seq_q ? delta[row] : 0.f;
      }
      __syncthreads();

      // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys x the tile's 32 rows: A from
      // K / V rows, B[d][row] = Q[row][d] / dO[row][d], a pair of one row each.
      float s[kBwdFragments][4] = {}, dp[kBwdFragments][4] = {};
      const T* k_rows = k_tile + (warp_key + g) * kLd + 2 * t;
      const T* v_rows = v_tile + (warp_key + g) * kLd + 2 * t;
#pragma unroll
      for (int step = 0; step < kDimSteps; ++step) {
        const uint32_t a_k[4] = {
            load_pair(k_rows + step * 16), load_pair(k_rows + 8 * kLd + step * 16),
            load_pair(k_rows + step * 16 + 8), load_pair(k_rows + 8 * kLd + step * 16 + 8)};
        const uint32_t a_v[4] = {
            load_pair(v_rows + step * 16), load_pair(v_rows + 8 * kLd + step * 16),
            load_pair(v_rows + step * 16 + 8), load_pair(v_rows + 8 * kLd + step * 16 + 8)};
#pragma unroll
        for (int n = 0; n < kBwdFragments; ++n) {
          const T* q_row = q_tile + (n * 8 + g) * kLd + step * 16 + 2 * t;
          const T* do_row = do_tile + (n * 8 + g) * kLd + step * 16 + 2 * t;
          const uint32_t b_q[2] = {load_pair(q_row), load_pair(q_row + 8)};
          const uint32_t b_do[2] = {load_pair(do_row), load_pair(do_row + 8)};
          mma_16x8x16(s[n], a_k, b_q, T{});
          mma_16x8x16(dp[n], a_v, b_do, T{});
        }
      }

      // P^T = exp(S^T - lse) (dropped where dropout drops), dS^T = P^T * (dP^T dropped - delta)
      // times the softcap's derivative.
#pragma unroll
      for (int n = 0; n < kBwdFragments; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int local_row = n * 8 + 2 * t + (e & 1);
          const int64_t row = row0 + local_row, key = my_keys[e / 2];
          float prob = 0.f, grad_score = 0.f, prob_dropped = 0.f;
          // Rows past seq_q have lse -inf; keys past seq_k are hidden by masked_score.
          if (lse_rows[local_row] != -INFINITY) {
            const float capped = mods.capped(s[n][e] * scale);
            const float score = masked_score<T>(capped + mods.bias(row, key), p, head, row, key);
            prob = __expf(score - lse_rows[local_row]);
            float grad_prob = dp[n][e];
            prob_dropped = prob;
            if (p.dropout.enabled && !sequence_dropout_keeps(p.dropout, head, row, key)) {
              prob_dropped = 0.f;
              grad_prob = 0.f;
            } else if (p.dropout.enabled) {
              prob_dropped *= keep_scale;
              grad_prob *= keep_scale;
            }
            grad_score = prob * (grad_prob - delta_rows[local_row]) * mods.cap_derivative(capped);
          }
          s[n][e] = prob_dropped;
          dp[n][e] = grad_score;
          store_as(ds_tile + local_row * kDsLd + warp_key + g + 8 * (e / 2), grad_score);
        }
      }

      // dV += P^T dO and dK += dS^T Q: A from the C fragments, B[row][d] two rows per register.
#pragma unroll
      for (int step = 0; step < kBwdRows / 16; ++step) {
        const uint32_t a_p[4] = {pack_floats(s[2 * step][0], s[2 * step][1], T{}),
                                 pack_floats(s[2 * step][2], s[2 * step][3], T{}),
                                 pack_floats(s[2 * step + 1][0], s[2 * step + 1][1], T{}),
                                 pack_floats(s[2 * step + 1][2], s[2 * step + 1][3], T{})};
        const uint32_t a_ds[4] = {pack_floats(dp[2 * step][0], dp[2 * step][1], T{}),
                                  pack_floats(dp[2 * step][2], dp[2 * step][3], T{}),
                                  pack_floats(dp[2 * step + 1][0], dp[2 * step + 1][1], T{}),
                                  pack_floats(dp[2 * step + 1][2], dp[2 * step + 1][3], T{})};
        const T* do_col = do_tile + (step * 16 + 2 * t) * kLd + g;
        const T* q_col = q_tile + (step * 16 + 2 * t) * kLd + g;
#pragma unroll
        for (int f = 0; f < kDimFragments; ++f) {
          const uint32_t b_do[2] = {pack_pair(do_col[f * 8], do_col[kLd + f * 8]),
                                    pack_pair(do_col[8 * kLd + f * 8], do_col[9 * kLd + f * 8])};
          const uint32_t b_q[2] = {pack_pair(q_col[f * 8], q_col[kLd + f * 8]),
                                   pack_pair(q_col[8 * kLd + f * 8], q_col[9 * kLd + f * 8])};
          mma_16x8x16(grad_v[f], a_p, b_do, T{});
          mma_16x8x16(grad_k[f], a_ds, b_q, T{});
        }
      }
      // A deterministic backward leaves dQ to its own pass (attention.cu).
      if (p.deterministic) continue;
      __syncthreads();  // dS complete
      float* grad_q_accum =
          static_cast<float*>(p.grad_q_accum) + head * p.lse_head_stride * p.head_dim;

      // dQ += dS K (scaled when dQ is cast): warp w takes rows 16 (w % 2) .. + 15 and head dims
      // kDim / 2 * (w / 2) .. + kDim / 2 - 1, over the block's 64 keys.
      const int dq_row = 16 * (warp % 2);
      const int dq_dim = kDim / 2 * (warp / 2);
      float grad_q[kDimFragments / 2][4] = {};
#pragma unroll
      for (int step = 0; step < kBwdKeys / 16; ++step) {
        const T* ds_row = ds_tile + (dq_row + g) * kDsLd + step * 16 + 2 * t;
        const uint32_t a[4] = {load_pair(ds_row), load_pair(ds_row + 8 * kDsLd),
                               load_pair(ds_row + 8), load_pair(ds_row + 8 * kDsLd + 8)};
        const T* k_col = k_tile + (step * 16 + 2 * t) * kLd + dq_dim + g;
#pragma unroll
        for (int f = 0; f < kDimFragments / 2; ++f) {
          const uint32_t b[2] = {pack_pair(k_col[f * 8], k_col[kLd + f * 8]),
                                 pack_pair(k_col[8 * kLd + f * 8], k_col[9 * kLd + f * 8])};
          mma_16x8x16(grad_q[f], a, b, T{});
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t row = row0 + dq_row + g + 8 * (e / 2);
        if (row >= p.seq_q) continue;
#pragma unroll
        for (int f = 0; f < kDimFragments / 2; ++f) {
          atomicAdd(grad_q_accum + row * p.head_dim + dq_dim + f * 8 + 2 * t + (e & 1),
                    grad_q[f][e]);
        }
      }
    }
  }

  // dK = dS^T (scale Q): the scale applied once here.
  T* grad_k_out = static_cast<T*>(p.grad_k) + kv_head * p.grad_k_strides.head;
  T* grad_v_out = static_cast<T*>(p.grad_v) + kv_head * p.grad_v_strides.head;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int64_t key = my_keys[e / 2];
    if (key >= p.seq_k) continue;
#pragma unroll
    for (int f = 0; f < kDimFragments; ++f) {
      const int64_t d = f * 8 + 2 * t + (e & 1);
      store_as(grad_k_out + key * p.grad_k_strides.row + d, grad_k[f][e] * scale);
      store_as(grad_v_out + key * p.grad_v_strides.row + d, grad_v[f][e]);
    }
  }
}

// dQ of a deterministic backward on the tensor cores: the forward's schedule (64 query rows
// of one head per block, 16 per warp, key tiles of 64 in order) with dQ = scale * dS K kept
// in registers, so every row's sum has one order and no atomics. Per tile: S = Q K^T and
// dP = dO V^T from register fragments of Q and dO, dS = P * (dP - delta) (dropped, times the
// softcap's derivative) in the C fragments, which feed dS K as A fragments.
template <typename T, int kDim>
__global__ void __launch_bounds__(kMmaThreads)
    attention_grad_q_mma(AttentionBackwardParams call, const int64_t* seed) {
  constexpr int kLd = kTileLd<kDim>;
  constexpr int kDimSteps = kDim / 16;
  constexpr int kDimFragments = kDim / 8;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  AttentionBackwardParams p = sequence_params(call, blockIdx.z);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kMmaRows;
  if (row0 >= p.seq_q) return;
  T* k_tile = reinterpret_cast<T*>(shared_bytes);  // [kMmaKeys, kLd]; first stages Q
  T* v_tile = k_tile + kMmaKeys * kLd;             // [kMmaKeys, kLd]; first stages dO

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int64_t head = blockIdx.y;
  const int64_t kv_head = head / (p.num_heads / p.num_kv_heads);
  if (p.dropout.enabled) p.dropout.seed = static_cast<uint64_t>(*seed);
  const float keep_scale = static_cast<float>(p.dropout.keep_scale);
  const HeadScoreMods<float> mods = HeadScoreMods<float>::of(p, head);
  const T* k = static_cast<const T*>(p.k) + kv_head * p.k_strides.head;
  const T* v = static_cast<const T*>(p.v) + kv_head * p.v_strides.head;

  load_tile<T, kDim>(k_tile, kMmaRows, static_cast<const T*>(p.q) + head * p.q_strides.head,
                     p.q_strides.row, row0, p.seq_q);
  load_tile<T, kDim>(v_tile, kMmaRows,
                     static_cast<const T*>(p.grad_out) + head * p.grad_out_strides.head,
                     p.grad_out_strides.row, row0, p.seq_q);
  __syncthreads();
  uint32_t q_frag[kDimSteps][4], do_frag[kDimSteps][4];
  load_a_fragments<T, kDim>(q_frag, k_tile + (warp * 16 + g) * kLd + 2 * t);
  load_a_fragments<T, kDim>(do_frag, v_tile + (warp * 16 + g) * kLd + 2 * t);

  // This thread's two rows: r = 0 is row g of the warp's 16, r = 1 row g + 8. A row past the
  // sequence gets lse -inf, which marks it as seeing nothing.
  const int64_t rows[2] = {row0 + warp * 16 + g, row0 + warp * 16 + g + 8};
  float row_lse[2], row_delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t element = head * p.lse_head_stride + rows[r];
    row_lse[r] = rows[r] < p.seq_q ? static_cast<const float*>(p.lse)[element] : -INFINITY;
    row_delta[r] = rows[r] < p.seq_q ? static_cast<const float*>(p.delta)[element] : 0.f;
  }
  float grad_q[kDimFragments][4] = {};
  const float scale = static_cast<float>(p.scale);

  const int64_t last_row = min(row0 + kMmaRows, p.seq_q) - 1;
  const int64_t key_begin = visible_keys(p.window, row0, p.seq_k).begin / kMmaKeys * kMmaKeys;
  const int64_t key_end = visible_keys(p.window, last_row, p.seq_k).end;
  for (int64_t key0 = key_begin; key0 < key_end; key0 += kMmaKeys) {
    __syncthreads();  // the previous tile (or Q and dO) is no longer read
    load_tile<T, kDim>(k_tile, kMmaKeys, k, p.k_strides.row, key0, p.seq_k);
    load_tile<T, kDim>(v_tile, kMmaKeys, v, p.v_strides.row, key0, p.seq_k);
    __syncthreads();

    // S = Q K^T and dP = dO V^T: B[d][key] = K[key][d] (V[key][d]), a pair of one row.
    float s[kFragmentsPerTile][4] = {}, dp[kFragmentsPerTile][4] = {};
#pragma unroll
    for (int n = 0; n < kFragmentsPerTile; ++n) {
      const T* k_row = k_tile + (n * 8 + g) * kLd + 2 * t;
      const T* v_row = v_tile + (n * 8 + g) * kLd + 2 * t;
#pragma unroll
      for (int step = 0; step < kDimSteps; ++step) {
        const uint32_t b_k[2] = {load_pair(k_row + step * 16), load_pair(k_row + step * 16 + 8)};
        const uint32_t b_v[2] = {load_pair(v_row + step * 16), load_pair(v_row + step * 16 + 8)};
        mma_16x8x16(s[n], q_frag[step], b_k, T{});
        mma_16x8x16(dp[n], do_frag[step], b_v, T{});
      }
    }

    // dS in place of S.
#pragma unroll
    for (int n = 0; n < kFragmentsPerTile; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int64_t row = rows[r], key = key0 + n * 8 + 2 * t + (e & 1);
        float grad_score = 0.f;
        if (row_lse[r] != -INFINITY) {
          const float capped = mods.capped(s[n][e] * scale);
          const float score = masked_score<T>(capped + mods.bias(row, key), p, head, row, key);
          float grad_prob = dp[n][e];
          if (p.dropout.enabled) {
            grad_prob =
                sequence_dropout_keeps(p.dropout, head, row, key) ? grad_prob * keep_scale : 0.f;
          }
          grad_score =
              __expf(score - row_lse[r]) * (grad_prob - row_delta[r]) * mods.cap_derivative(capped);
        }
        s[n][e] = grad_score;
      }
    }

    // dQ += dS K: A from the dS C fragments.
    mma_scores_by_tile<T, kDim>(grad_q, s, k_tile + 2 * t * kLd + g);
  }

  T* grad_q_out = static_cast<T*>(p.grad_q) + head * p.grad_q_strides.head;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= p.seq_q) continue;
    T* out_row = grad_q_out + rows[r] * p.grad_q_strides.row + 2 * t;
#pragma unroll
    for (int f = 0; f < kDimFragments; ++f) {
      store_as(out_row + f * 8, grad_q[f][2 * r] * scale);
      store_as(out_row + f * 8 + 1, grad_q[f][2 * r + 1] * scale);
    }
  }
}

// Calls launch(std::integral_constant<int, kDim>) for the compiled head dim equal to
// head_dim; false when none is.
template <typename Launch, int... kSlots>
bool for_compiled_head_dim(int64_t head_dim, Launch&& launch,
                           std::integer_sequence<int, kSlots...>) {
  auto try_slot = [&](auto slot) {
    constexpr int kSlot = decltype(slot)::value;
    if constexpr (((MHA_EXT_HEAD_DIM_MASK >> kSlot) & 1) == 0) {
      return false;
    } else {
      constexpr int kDim = 16 * (kSlot + 1);
      if (head_dim != kDim) return false;
      launch(std::integral_constant<int, kDim>{});
      return true;
    }
  };
  return (try_slot(std::integral_constant<int, kSlots>{}) || ...);
}

constexpr auto kHeadDimSlots = std::make_integer_sequence<int, 16>{};  // head dims 16, 32, ..., 256

// Launches kernel<<<grid, kMmaThreads, shared, stream>>>(params, seed), opting into more than
// 48 KiB of shared memory where needed; errors surface through cudaGetLastError.
template <typename Params>
void launch_mma(void (*kernel)(Params, const int64_t*), dim3 grid, size_t shared,
                cudaStream_t stream, const Params& params, const int64_t* seed) {
  if (shared > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(shared));
  }
  kernel<<<grid, kMmaThreads, shared, stream>>>(params, seed);
}

template <typename T>
bool forward_for_dtype(const AttentionForwardParams& p, const int64_t* seed, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(p.seq_q, kMmaRows)),
                  static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch));
  return for_compiled_head_dim(
      p.head_dim,
      [&](auto dim) {
        constexpr int kDim = decltype(dim)::value;
        launch_mma(attention_forward_mma<T, kDim>, grid, 2 * kMmaKeys * kTileLd<kDim> * sizeof(T),
                   stream, p, seed);
      },
      kHeadDimSlots);
}

template <typename T>
bool backward_for_dtype(const AttentionBackwardParams& p, const int64_t* seed,
                        cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(p.seq_k, kBwdKeys)),
                  static_cast<unsigned>(p.num_kv_heads), static_cast<unsigned>(p.batch));
  return for_compiled_head_dim(
      p.head_dim,
      [&](auto dim) {
        constexpr int kDim = decltype(dim)::value;
        launch_mma(attention_backward_mma<T, kDim>, grid, kBwdSharedBytes<kDim>, stream, p, seed);
      },
      kHeadDimSlots);
}

template <typename T>
bool grad_q_for_dtype(const AttentionBackwardParams& p, const int64_t* seed, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(p.seq_q, kMmaRows)),
                  static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch));
  return for_compiled_head_dim(
      p.head_dim,
      [&](auto dim) {
        constexpr int kDim = decltype(dim)::value;
        launch_mma(attention_grad_q_mma<T, kDim>, grid, 2 * kMmaKeys * kTileLd<kDim> * sizeof(T),
                   stream, p, seed);
      },
      kHeadDimSlots);
}

bool aligned_rows(const void* data, const RowStrides& strides) {
  // 16-byte loads: every row of 16-bit elements starts on a multiple of 8 elements.
  return reinterpret_cast<uintptr_t>(data) % 16 == 0 && strides.batch % 8 == 0 &&
         strides.head % 8 == 0 && strides.row % 8 == 0;
}

// fp16/bf16 with one head dim for q, k and v, and rows the 16-byte tile loads can read.
bool tensor_core_inputs(const AttentionForwardParams& p) {
  return (p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16) &&
         p.head_dim == p.head_dim_v && aligned_rows(p.q, p.q_strides) &&
         aligned_rows(p.k, p.k_strides) && aligned_rows(p.v, p.v_strides);
}

}  // namespace

bool tensor_core_forward(const AttentionForwardParams& p, const int64_t* seed,
                         cudaStream_t stream) {
  if (!tensor_core_inputs(p)) return false;
  return p.dtype == DType::kFloat16 ? forward_for_dtype<__half>(p, seed, stream)
                                    : forward_for_dtype<__nv_bfloat16>(p, seed, stream);
}

bool tensor_core_backward(const AttentionBackwardParams& p, const int64_t* seed,
                          cudaStream_t stream) {
  if (!tensor_core_inputs(p) || !aligned_rows(p.grad_out, p.grad_out_strides)) return false;
  return p.dtype == DType::kFloat16 ? backward_for_dtype<__half>(p, seed, stream)
                                    : backward_for_dtype<__nv_bfloat16>(p, seed, stream);
}

bool tensor_core_grad_q(const AttentionBackwardParams& p, const int64_t* seed,
                        cudaStream_t stream) {
  if (!tensor_core_inputs(p) || !aligned_rows(p.grad_out, p.grad_out_strides)) return false;
  return p.dtype == DType::kFloat16 ? grad_q_for_dtype<__half>(p, seed, stream)
                                    : grad_q_for_dtype<__nv_bfloat16>(p, seed, stream);
}

}  // namespace mha_ext::cuda
