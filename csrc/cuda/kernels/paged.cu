// Paged KV cache on the GPU: the in-place append, attention through block tables (decode
// and chunked prefill, sliding window, softcap, ALiBi and sinks; split-K with a logsumexp
// merge) and merge_attention_states.
//
// The index tensors live on the device, so nothing here can raise on a bad index without a
// host sync; instead every kernel guards what it reads and writes: an append skips slots
// outside the cache, attention hides keys whose block id is outside the cache and clamps
// lengths to what a block-table row holds. The op wrappers offer an opt-in host check
// (MHA_EXT_CHECK_INDICES=1) that raises the CPU backend's errors instead.
#include <algorithm>

#include "cuda/kernels/launch_helpers.h"
#include "cuda/kernels/launchers.h"
#include "cuda/kernels/simt_rows.cuh"
#include "mha_ext/float8.h"
#include "mha_ext/paged_cache.h"
#include "mha_ext/score_mods.h"

namespace mha_ext::cuda {
namespace {

constexpr int kCopyThreads = 256;

// One thread per (token, kv head, unit of unit_t bytes) of the key and the value row.
template <typename unit_t>
__global__ void paged_kv_append_kernel(PagedAppendParams p) {
  const int64_t key_units = p.head_dim * p.element_size / static_cast<int64_t>(sizeof(unit_t));
  const int64_t value_units = p.head_dim_v * p.element_size / static_cast<int64_t>(sizeof(unit_t));
  const int64_t units = key_units + value_units;
  const int64_t total = p.num_tokens * p.num_kv_heads * units;
  const int64_t capacity = p.num_blocks * p.block_size;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t token = idx / (p.num_kv_heads * units);
    const int64_t head = idx / units % p.num_kv_heads;
    const int64_t slot = p.slot_mapping[token];
    if (slot < 0 || slot >= capacity)
      continue;  // -1 skips the token; out of range is never written
    const CacheSlot location = slot_location(slot, p.block_size);
    const bool is_key = idx % units < key_units;
    const int64_t unit = is_key ? idx % units : idx % units - key_units;
    const TokenStrides& src_strides = is_key ? p.key_strides : p.value_strides;
    const CacheStrides& dst_strides = is_key ? p.k_cache_strides : p.v_cache_strides;
    const char* src = static_cast<const char*>(is_key ? p.key : p.value) +
                      (token * src_strides.token + head * src_strides.head) * p.element_size;
    char* dst = static_cast<char*>(is_key ? p.k_cache : p.v_cache) +
                cache_row_offset(dst_strides, location, head) * p.element_size;
    reinterpret_cast<unit_t*>(dst)[unit] = reinterpret_cast<const unit_t*>(src)[unit];
  }
}

// An 8-bit cache's rows quantized as they are written (CacheFormat, paged_params.h), one
// warp per (token, kv head) key or value row: the int8 row's absmax reduced across the warp
// first. The same arithmetic as the CPU append (true fp32 division, ties to even), so both
// write the same bits.
template <typename input_t>
__global__ void paged_kv_append_quantized(PagedAppendParams p) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t rows = p.num_tokens * p.num_kv_heads * 2;  // key, then value, per head
  const int64_t capacity = p.num_blocks * p.block_size;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarpSize);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarpSize) + warp; row < rows;
       row += warps) {
    const int64_t token = row / (2 * p.num_kv_heads), head = row / 2 % p.num_kv_heads;
    const bool is_key = row % 2 == 0;
    const int64_t slot = p.slot_mapping[token];
    if (slot < 0 || slot >= capacity) continue;  // the whole warp skips: slot is per row
    const CacheSlot location = slot_location(slot, p.block_size);
    const TokenStrides& src_strides = is_key ? p.key_strides : p.value_strides;
    const QuantScales& scales = is_key ? p.k_scales : p.v_scales;
    const int64_t dim = is_key ? p.head_dim : p.head_dim_v;
    const input_t* src = static_cast<const input_t*>(is_key ? p.key : p.value) +
                         token * src_strides.token + head * src_strides.head;
    uint8_t* dst = static_cast<uint8_t*>(is_key ? p.k_cache : p.v_cache) +
                   cache_row_offset(is_key ? p.k_cache_strides : p.v_cache_strides, location, head);
    if (p.format == CacheFormat::kInt8) {
      float absmax = 0.f;
      for (int64_t d = lane; d < dim; d += kWarpSize) absmax = fmaxf(absmax, fabsf(widen(src[d])));
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
        absmax = fmaxf(absmax, __shfl_xor_sync(0xFFFFFFFFu, absmax, offset));
      const float scale = absmax / 127.f;
      for (int64_t d = lane; d < dim; d += kWarpSize) {
        const float stored =
            scale == 0.f ? 0.f : fminf(fmaxf(rintf(widen(src[d]) / scale), -127.f), 127.f);
        dst[d] = static_cast<uint8_t>(static_cast<int8_t>(stored));
      }
      if (lane == 0) scales.per_row[cache_row_offset(scales.strides, location, head)] = scale;
    } else {
      for (int64_t d = lane; d < dim; d += kWarpSize) {
        const float y = widen(src[d]) / scales.per_tensor;
        dst[d] = float_to_e4m3fn(y != y ? y : fminf(fmaxf(y, -448.f), 448.f));
      }
    }
  }
}

// An element of a cache in the accumulation type: an 8-bit one in units whose row scale and
// per-tensor scale the tile loads apply.
template <typename acc_t, typename cache_t>
__device__ __forceinline__ acc_t cached_value(cache_t x) {
  return static_cast<acc_t>(widen(x));
}
template <typename acc_t>
__device__ __forceinline__ acc_t cached_value(int8_t x) {
  return static_cast<acc_t>(x);
}
template <typename acc_t>
__device__ __forceinline__ acc_t cached_value(Float8E4M3 x) {
  return static_cast<acc_t>(e4m3fn_to_float(x.bits));
}

// The rows a paged-attention block works on: rows of the sequence's queries x the kv head's
// group of query heads, query-major, in tiles of kSimtRows (a whole GQA group of up to 16
// heads shares every K/V tile).
struct PagedRowTile {
  int64_t first;  // first row of the tile
  int64_t rows;   // rows in the tile
};

// The element offset of cached token `position` of kv head `kv_head`, or -1 when the block
// table names a block outside the cache.
__device__ __forceinline__ int64_t cached_row(const PagedAttentionParams& p,
                                              const int32_t* block_table,
                                              const CacheStrides& strides, int64_t kv_head,
                                              int64_t position) {
  const CacheSlot location = position_location(block_table, position, p.block_size);
  if (location.block < 0 || location.block >= p.num_blocks) return -1;
  return cache_row_offset(strides, location, kv_head);
}

// What an element of cached token `position` of kv head `kv_head` is multiplied by to give
// its value: the row's int8 scale times the per-tensor scale (1 and 1 for a plain cache).
// The block must be inside the cache (cached_row >= 0).
__device__ __forceinline__ float cached_row_scale(const PagedAttentionParams& p,
                                                  const int32_t* block_table,
                                                  const QuantScales& scales, int64_t kv_head,
                                                  int64_t position) {
  if (scales.per_row == nullptr) return scales.per_tensor;
  const CacheSlot location = position_location(block_table, position, p.block_size);
  return scales.per_row[cache_row_offset(scales.strides, location, kv_head)] * scales.per_tensor;
}

// Joins a sink (a logit with no value) to row i's softmax as one more key whose value is 0:
// lse = log(e^sink + sum e^s), out = sum e^s v / (e^sink + sum e^s). A row that saw no key
// finishes with output 0 and lse = sink.
template <typename acc_t, int kDimChunks>
__device__ void add_sink(SimtRows<acc_t, kDimChunks>& state, int i, acc_t sink) {
  const acc_t new_max = fmax(state.row_max[i], sink);
  if (new_max == acc_t(-INFINITY)) return;  // a sink of -inf changes nothing
  const acc_t rescale = exp_of(state.row_max[i] - new_max);
  state.row_sum[i] = state.row_sum[i] * rescale + exp_of(sink - new_max);
  state.row_max[i] = new_max;
#pragma unroll
  for (int c = 0; c < kDimChunks; ++c) state.acc[i][c] *= rescale;
}

// q and out of scalar_t, the caches of cache_t (scalar_t, int8_t or Float8E4M3: tiles are
// dequantized as they are staged in shared memory).
template <typename scalar_t, typename cache_t, int kDimChunks>
__global__ void __launch_bounds__(kSimtThreads) paged_attention_simt(PagedAttentionParams p) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const SimtTiles tiles{p.head_dim, p.head_dim_v};
  acc_t* q_tile = reinterpret_cast<acc_t*>(shared_bytes);  // [kSimtRows, head_dim]
  acc_t* k_tile = q_tile + kSimtRows * p.head_dim;         // [kSimtKeys, head_dim + 1]
  acc_t* v_tile = k_tile + kSimtKeys * tiles.k_ld();       // [kSimtKeys, head_dim_v]
  __shared__ bool key_cached[kSimtKeys];                   // false: the key's block is invalid

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t splits = p.num_kv_splits;
  const int64_t seq = blockIdx.x / (p.num_kv_heads * splits);
  const int64_t kv_head = blockIdx.x / splits % p.num_kv_heads;
  const int64_t split = blockIdx.x % splits;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t q_begin = p.cu_seqlens_q[seq];
  const int64_t num_queries =
      max(static_cast<int64_t>(p.cu_seqlens_q[seq + 1]) - q_begin, int64_t(0));
  const int64_t seq_len =
      min(static_cast<int64_t>(p.seq_lens[seq]), p.max_blocks_per_seq * p.block_size);
  const int32_t* block_table = p.block_tables + seq * p.block_table_stride;
  const cache_t* k_cache = static_cast<const cache_t*>(p.k_cache);
  const cache_t* v_cache = static_cast<const cache_t*>(p.v_cache);
  const int first_row = warp * kSimtRowsPerWarp;          // of the tile's rows
  const int64_t diagonal_offset = seq_len - num_queries;  // query i's position - i
  const acc_t softcap = static_cast<acc_t>(p.mods.softcap);

  const int64_t row_tiles = ceil_div<int64_t>(num_queries * group, kSimtRows);
  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y) {
    const PagedRowTile rows{tile * kSimtRows, min(static_cast<int64_t>(kSimtRows),
                                                  num_queries * group - tile * kSimtRows)};
    // The keys the tile's queries see (from the first one's window to the last one: queries
    // are their sequence's last tokens), this block's split of them.
    const KeyRange keys =
        split_key_range(paged_chunk_keys(seq_len, num_queries, rows.first / group,
                                         (rows.first + rows.rows - 1) / group, p.window_left),
                        split, splits, kSimtKeys);

    __syncthreads();  // the previous tile's q_tile is no longer read
    for (int64_t idx = threadIdx.x; idx < kSimtRows * p.head_dim; idx += blockDim.x) {
      const int64_t r = idx / p.head_dim, d = idx % p.head_dim, row = rows.first + r;
      const int64_t token = q_begin + row / group;
      acc_t value = 0;
      if (r < rows.rows && token < p.total_q) {
        const scalar_t* q = static_cast<const scalar_t*>(p.q) + token * p.q_strides.token +
                            (kv_head * group + row % group) * p.q_strides.head;
        value = static_cast<acc_t>(widen(q[d])) * static_cast<acc_t>(p.scale);
      }
      q_tile[idx] = value;
    }

    SimtRows<acc_t, kDimChunks> state;
    state.init();
    for (int64_t key0 = keys.begin; key0 < keys.end; key0 += kSimtKeys) {
      const int64_t tile_keys = min(static_cast<int64_t>(kSimtKeys), keys.end - key0);
      __syncthreads();  // the previous K/V tile is no longer read (and q_tile is complete)
      if (threadIdx.x < kSimtKeys) {
        key_cached[threadIdx.x] =
            threadIdx.x < tile_keys &&
            cached_row(p, block_table, p.k_cache_strides, kv_head, key0 + threadIdx.x) >= 0;
      }
      for (int64_t idx = threadIdx.x; idx < kSimtKeys * p.head_dim; idx += blockDim.x) {
        const int64_t j = idx / p.head_dim, d = idx % p.head_dim;
        const int64_t offset =
            j < tile_keys ? cached_row(p, block_table, p.k_cache_strides, kv_head, key0 + j) : -1;
        k_tile[j * tiles.k_ld() + d] =
            offset >= 0 ? cached_value<acc_t>(k_cache[offset + d]) *
                              cached_row_scale(p, block_table, p.k_scales, kv_head, key0 + j)
                        : acc_t(0);
      }
      for (int64_t idx = threadIdx.x; idx < kSimtKeys * p.head_dim_v; idx += blockDim.x) {
        const int64_t j = idx / p.head_dim_v, d = idx % p.head_dim_v;
        const int64_t offset =
            j < tile_keys ? cached_row(p, block_table, p.v_cache_strides, kv_head, key0 + j) : -1;
        v_tile[j * p.head_dim_v + d] =
            offset >= 0 ? cached_value<acc_t>(v_cache[offset + d]) *
                              cached_row_scale(p, block_table, p.v_scales, kv_head, key0 + j)
                        : acc_t(0);
      }
      __syncthreads();

      // This lane's key's score for each row, modified as score_mods.h says, or -inf where
      // the row does not see the key (past its query, before its window, not cached).
      acc_t scores[kSimtRowsPerWarp];
      const int64_t key = key0 + lane;
#pragma unroll
      for (int i = 0; i < kSimtRowsPerWarp; ++i) {
        const int64_t row = rows.first + first_row + i, query = row / group;
        const KeyRange visible = paged_visible_keys(seq_len, num_queries, query, p.window_left);
        scores[i] = -INFINITY;
        if (first_row + i < rows.rows && key_cached[lane] && key >= visible.begin &&
            key < visible.end) {
          acc_t score = row_key_dot(q_tile + (first_row + i) * p.head_dim, k_tile, tiles.k_ld(),
                                    lane, p.head_dim);
          if (softcap > acc_t(0)) score = softcapped(score, softcap);
          if (p.mods.alibi_slopes != nullptr) {
            const acc_t slope = alibi_slope<acc_t>(p.mods, seq, kv_head * group + row % group);
            score += alibi_bias(slope, query, key, diagonal_offset);
          }
          scores[i] = score;
        }
      }
      state.softmax_step(scores);
      state.accumulate(scores, v_tile, p.head_dim_v, lane);
    }

#pragma unroll
    for (int i = 0; i < kSimtRowsPerWarp; ++i) {
      const int64_t row = rows.first + first_row + i;
      const int64_t token = q_begin + row / group, head = kv_head * group + row % group;
      if (first_row + i >= rows.rows || token >= p.total_q) continue;
      acc_t row_lse;
      if (splits == 1) {
        if (p.sinks != nullptr) add_sink(state, i, sink_logit<acc_t>(p.sinks, head));
        row_lse = state.finish(
            i,
            static_cast<scalar_t*>(p.out) + token * p.out_strides.token + head * p.out_strides.head,
            p.head_dim_v, lane);
        if (lane == 0) static_cast<acc_t*>(p.lse)[token * p.num_heads + head] = row_lse;
      } else {
        const int64_t partial_row = (split * p.total_q + token) * p.num_heads + head;
        row_lse = state.finish(i, static_cast<acc_t*>(p.partial_out) + partial_row * p.head_dim_v,
                               p.head_dim_v, lane);
        if (lane == 0) static_cast<acc_t*>(p.partial_lse)[partial_row] = row_lse;
      }
    }
  }
}

// out = the splits' partial outputs merged by logsumexp, then the head's sink joined once (a
// state of logsumexp sink and output 0); one thread per output element.
template <typename scalar_t>
__global__ void merge_splits_kernel(PagedAttentionParams p) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  const int64_t rows = p.total_q * p.num_heads;
  const int64_t total = rows * p.head_dim_v;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const acc_t* partial_out = static_cast<const acc_t*>(p.partial_out);
  const acc_t* partial_lse = static_cast<const acc_t*>(p.partial_lse);
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t row = idx / p.head_dim_v, d = idx % p.head_dim_v;
    acc_t lse = partial_lse[row];
    acc_t value = partial_out[idx];
    for (int64_t split = 1; split < p.num_kv_splits; ++split) {
      const MergedState<acc_t> merged = merge_softmax_states(lse, partial_lse[split * rows + row]);
      value = merged.weight_a * value + merged.weight_b * partial_out[split * total + idx];
      lse = merged.lse;
    }
    const int64_t token = row / p.num_heads, head = row % p.num_heads;
    if (p.sinks != nullptr) {
      const MergedState<acc_t> merged = merge_softmax_states(lse, sink_logit<acc_t>(p.sinks, head));
      value *= merged.weight_a;
      lse = merged.lse;
    }
    store_as(
        static_cast<scalar_t*>(p.out) + token * p.out_strides.token + head * p.out_strides.head + d,
        value);
    if (d == 0) static_cast<acc_t*>(p.lse)[row] = lse;
  }
}

template <typename scalar_t>
__global__ void merge_states_kernel(MergeStatesParams p) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  const int64_t total = p.rows * p.head_dim;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t row = idx / p.head_dim, d = idx % p.head_dim;
    const MergedState<acc_t> merged = merge_softmax_states(static_cast<const acc_t*>(p.lse_a)[row],
                                                           static_cast<const acc_t*>(p.lse_b)[row]);
    const acc_t a = widen(static_cast<const scalar_t*>(p.out_a)[row * p.out_a_stride + d]);
    const acc_t b = widen(static_cast<const scalar_t*>(p.out_b)[row * p.out_b_stride + d]);
    store_as(static_cast<scalar_t*>(p.out) + row * p.out_stride + d,
             merged.weight_a * a + merged.weight_b * b);
    if (d == 0) static_cast<acc_t*>(p.lse)[row] = merged.lse;
  }
}

template <typename unit_t>
cudaError_t launch_append(const PagedAppendParams& p, cudaStream_t stream) {
  const int64_t units =
      (p.head_dim + p.head_dim_v) * p.element_size / static_cast<int64_t>(sizeof(unit_t));
  paged_kv_append_kernel<unit_t>
      <<<stride_blocks(p.num_tokens * p.num_kv_heads * units, kCopyThreads), kCopyThreads, 0,
         stream>>>(p);
  return cudaGetLastError();
}

// Whether every key and value row, in the inputs and the caches, can move in 16-byte units.
bool append_rows_aligned(const PagedAppendParams& p) {
  const int64_t row_strides[] = {p.key_strides.token,
                                 p.key_strides.head,
                                 p.value_strides.token,
                                 p.value_strides.head,
                                 p.k_cache_strides.block,
                                 p.k_cache_strides.head,
                                 p.k_cache_strides.offset,
                                 p.v_cache_strides.block,
                                 p.v_cache_strides.head,
                                 p.v_cache_strides.offset,
                                 p.head_dim,
                                 p.head_dim_v};
  for (const int64_t stride : row_strides) {
    if (stride * p.element_size % 16 != 0) return false;
  }
  for (const void* data :
       {p.key, p.value, static_cast<const void*>(p.k_cache), static_cast<const void*>(p.v_cache)}) {
    if (reinterpret_cast<uintptr_t>(data) % 16 != 0) return false;
  }
  return true;
}

}  // namespace

cudaError_t launch_paged_kv_append(const PagedAppendParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_kv_heads == 0) return cudaSuccess;
  if (p.format != CacheFormat::kPlain) {
    constexpr int kWarpsPerBlock = kCopyThreads / kWarpSize;
    return dispatch_dtype(p.dtype, [&](auto tag) {
      using input_t = decltype(tag);
      if constexpr (!std::is_same_v<input_t, double>) {  // the op layer allows no fp64 rows
        paged_kv_append_quantized<input_t>
            <<<stride_blocks(p.num_tokens * p.num_kv_heads * 2, kWarpsPerBlock), kCopyThreads, 0,
               stream>>>(p);
        return cudaGetLastError();
      }
      return cudaErrorInvalidValue;
    });
  }
  if (append_rows_aligned(p)) return launch_append<uint4>(p, stream);
  switch (p.element_size) {
    case 1: return launch_append<uint8_t>(p, stream);
    case 2: return launch_append<uint16_t>(p, stream);
    case 4: return launch_append<uint32_t>(p, stream);
    case 8: return launch_append<uint64_t>(p, stream);
  }
  return cudaErrorInvalidValue;
}

// Calls kernel(cache_t{}) with the element type of a cache of this format read with queries
// of scalar_t; 8-bit caches take no fp64 queries (the op layer refuses them).
template <typename scalar_t, typename Kernel>
cudaError_t dispatch_cache_type(CacheFormat format, Kernel&& kernel) {
  if constexpr (!std::is_same_v<scalar_t, double>) {
    if (format == CacheFormat::kInt8) return kernel(int8_t{});
    if (format == CacheFormat::kFloat8E4M3) return kernel(Float8E4M3{});
  }
  if (format != CacheFormat::kPlain) return cudaErrorInvalidValue;
  return kernel(scalar_t{});
}

int64_t paged_attention_splits(const PagedAttentionParams& p, int num_sms) {
  // Split long contexts while sequences x kv heads leave SMs idle (two blocks per SM); a
  // split below 256 keys costs more in merging than it saves. A window counts only the keys
  // a row tile's queries see.
  const int64_t blocks = std::max<int64_t>(p.batch * p.num_kv_heads, 1);
  const int64_t wanted = ceil_div<int64_t>(2 * static_cast<int64_t>(num_sms), blocks);
  const int64_t group = std::max<int64_t>(p.num_heads / p.num_kv_heads, 1);
  const int64_t tile_queries = ceil_div<int64_t>(kSimtRows, group);
  const int64_t keys = paged_max_chunk_keys(p, std::min(p.max_queries_per_seq, tile_queries));
  return std::max<int64_t>(1, std::min(wanted, keys / 256));
}

cudaError_t launch_paged_attention(const PagedAttentionParams& p, int num_sms,
                                   cudaStream_t stream) {
  if (p.total_q == 0 || p.num_heads == 0) return cudaSuccess;
  const cudaError_t status = dispatch_dtype(p.dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    return dispatch_cache_type<scalar_t>(p.format, [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      using acc_t = typename AccumulateType<scalar_t>::type;
      const int64_t column_blocks = p.batch * p.num_kv_heads * p.num_kv_splits;
      // Row tiles per sequence run as grid rows, as many as keep the SMs busy; each block
      // loops over the tiles its row index selects.
      const int64_t group = p.num_heads / p.num_kv_heads;
      const int64_t max_row_tiles = ceil_div<int64_t>(p.max_queries_per_seq * group, kSimtRows);
      const int64_t row_blocks =
          std::clamp<int64_t>(ceil_div<int64_t>(2 * static_cast<int64_t>(num_sms), column_blocks),
                              1, std::clamp<int64_t>(max_row_tiles, 1, 65535));
      const size_t shared = SimtTiles{p.head_dim, p.head_dim_v}.elements() * sizeof(acc_t);
      cudaError_t launched = cudaSuccess;
      dispatch_dim_chunks(std::max(p.head_dim, p.head_dim_v), [&](auto chunks) {
        auto* kernel = paged_attention_simt<scalar_t, cache_t, decltype(chunks)::value>;
        if (shared > 48 * 1024) {
          launched = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(shared));
          if (launched != cudaSuccess) return true;
        }
        kernel<<<dim3(static_cast<unsigned>(column_blocks), static_cast<unsigned>(row_blocks)),
                 kSimtThreads, shared, stream>>>(p);
        launched = cudaGetLastError();
        return true;
      });
      if (launched != cudaSuccess || p.num_kv_splits == 1) return launched;
      merge_splits_kernel<scalar_t>
          <<<stride_blocks(p.total_q * p.num_heads * p.head_dim_v, kCopyThreads), kCopyThreads, 0,
             stream>>>(p);
      return cudaGetLastError();
    });
  });
  return status;
}

cudaError_t launch_merge_attention_states(const MergeStatesParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.head_dim == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    merge_states_kernel<scalar_t>
        <<<stride_blocks(p.rows * p.head_dim, kCopyThreads), kCopyThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace mha_ext::cuda
