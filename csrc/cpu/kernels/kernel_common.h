#pragma once
// Pieces shared by the CPU kernels: accumulation types, per-thread scratch, tile loads and
// stores, the online-softmax step and the dtype switch.
//
// Included by an ISA translation unit after it defines CPU_CAPABILITY.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "mha_ext/attention_params.h"

namespace mha_ext::cpu {
inline namespace CPU_CAPABILITY {

template <typename scalar_t>
struct AccumulateType {
  using type = float;
};
template <>
struct AccumulateType<double> {
  using type = double;
};

constexpr int64_t kBlockQ = kQueryBlock;
constexpr int64_t kBlockK = kKeyBlock;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Per-thread scratch that outlives calls: memory touched for the first time is slow on
// these machines, so each thread keeps its buffer and only ever grows it.
template <typename T>
T* thread_scratch(int64_t elements) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < elements) buffer.resize(elements);
  return buffer.data();
}

// dst[r * ld + c] = src[r * src_stride + c] * factor for r < rows, c < cols, converted to
// acc_t. Query tiles load with factor = softmax scale, so scores come out of the GEMM scaled.
template <typename scalar_t, typename acc_t>
void load_rows(const scalar_t* src, int64_t src_stride, int64_t rows, int64_t cols, acc_t* dst,
               int64_t ld, acc_t factor = acc_t(1)) {
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* in = src + r * src_stride;
    acc_t* out = dst + r * ld;
    if (factor == acc_t(1)) {
      for (int64_t c = 0; c < cols; ++c) out[c] = static_cast<acc_t>(in[c]);
    } else {
      for (int64_t c = 0; c < cols; ++c) out[c] = static_cast<acc_t>(in[c]) * factor;
    }
  }
}

// dst[c * dst_ld + r] = src[r * src_ld + c]. at::vec transposes fp32 in 16 x 16 AVX-512
// register blocks (plain loops on other ISAs and for fp64).
template <typename acc_t>
void transpose_tile(const acc_t* src, int64_t src_ld, int64_t rows, int64_t cols, acc_t* dst,
                    int64_t dst_ld) {
  at::vec::transpose_mxn<acc_t>(src, src_ld, dst, dst_ld, static_cast<int>(rows),
                                static_cast<int>(cols));
}

// dst[c * ld + r] = src[r * src_stride + c]: a K or V block laid out as K^T / V^T. Inputs
// of another type are converted into `staging` ([rows, cols]) first.
template <typename scalar_t, typename acc_t>
void load_rows_transposed(const scalar_t* src, int64_t src_stride, int64_t rows, int64_t cols,
                          acc_t* dst, int64_t ld, acc_t* staging) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    transpose_tile(src, src_stride, rows, cols, dst, ld);
  } else {
    load_rows(src, src_stride, rows, cols, staging, cols);
    transpose_tile(staging, cols, rows, cols, dst, ld);
  }
}

// dst[c] = src[c] * factor, converted to the output type.
template <typename scalar_t, typename acc_t>
void store_row(const acc_t* src, int64_t cols, acc_t factor, scalar_t* dst) {
  for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<scalar_t>(src[c] * factor);
}

// One key tile's step of a row's online softmax. On entry s holds the tile's scores (-inf
// where hidden); on exit it holds exp(s - row_max). The running max moves lazily: only when
// a tile's max exceeds it by more than kRescaleMargin does it jump to that max, with the
// sum and the row's output accumulator rescaled. Most tiles thus skip the rescale, and
// p = exp(s - row_max) stays below e^8 (about 3000), harmless in fp32 sums. While a row has
// seen no key, its tile gets p = 0 and nothing changes.
// score_scale (> 0) multiplies the scores first, fused into the exp: a kernel whose GEMM
// left them unscaled saves a pass over the tile (1 keeps the result bit for bit).
template <typename acc_t>
void online_softmax_step(acc_t* s, int64_t cols, acc_t& row_max, acc_t& row_sum, acc_t* o_row,
                         int64_t head_dim_v, acc_t score_scale = acc_t(1)) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr acc_t kMinusInf = -std::numeric_limits<acc_t>::infinity();
  constexpr acc_t kRescaleMargin = 8;
  const acc_t tile_max = score_scale * at::vec::reduce_all<acc_t>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, s, cols);
  if (tile_max == kMinusInf && row_max == kMinusInf) {
    std::fill(s, s + cols, acc_t(0));
    return;
  }
  if (tile_max > row_max + kRescaleMargin) {  // also the first tile with a visible key
    if (row_sum != acc_t(0)) {
      const acc_t rescale = std::exp(row_max - tile_max);
      row_sum *= rescale;
      at::vec::map([rescale](Vec x) { return x * Vec(rescale); }, o_row, o_row, head_dim_v);
    }
    row_max = tile_max;
  }
  // p = exp(score_scale * s - row_max), summed in the same pass.
  const Vec scale_vec(score_scale);
  const Vec minus_max(-row_max);
  Vec sum_vec(acc_t(0));
  int64_t c = 0;
  for (; c + Vec::size() <= cols; c += Vec::size()) {
    const Vec p = at::vec::fmadd(Vec::loadu(s + c), scale_vec, minus_max).exp_u20();
    p.store(s + c);
    sum_vec = sum_vec + p;
  }
  if (c < cols) {
    const int tail = static_cast<int>(cols - c);
    const Vec p = at::vec::fmadd(Vec::loadu(s + c, tail), scale_vec, minus_max).exp_u20();
    p.store(s + c, tail);
    sum_vec = sum_vec + Vec::set(Vec(acc_t(0)), p, tail);  // lanes past the row add nothing
  }
  row_sum += at::vec::vec_reduce_all<acc_t>([](Vec& a, Vec& b) { return a + b; }, sum_vec);
}

// Writes a finished row: out = o / sum, and returns its logsumexp. A row that saw no key has
// sum 0: output 0 and logsumexp -inf, never NaN.
template <typename scalar_t, typename acc_t>
acc_t finish_row(const acc_t* o_row, int64_t head_dim_v, acc_t row_max, acc_t row_sum,
                 scalar_t* out_row) {
  const bool empty = row_sum == acc_t(0);
  store_row(o_row, head_dim_v, empty ? acc_t(0) : acc_t(1) / row_sum, out_row);
  return empty ? -std::numeric_limits<acc_t>::infinity() : row_max + std::log(row_sum);
}

template <typename Kernel>
void dispatch_dtype(DType dtype, Kernel&& kernel) {
  switch (dtype) {
    case DType::kFloat32: return kernel(float{});
    case DType::kFloat64: return kernel(double{});
    case DType::kBFloat16: return kernel(c10::BFloat16{});
    case DType::kFloat16: return kernel(c10::Half{});
  }
  throw std::invalid_argument("mha_ext: attention kernel called with an unknown dtype");
}

}  // namespace CPU_CAPABILITY
}  // namespace mha_ext::cpu
