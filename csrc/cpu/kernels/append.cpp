// The CPU append kernel (see kernels.h).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/kernels/kernels.h"
#include "mha_ext/paged_cache.h"

namespace mha_ext::cpu {
namespace {

// Largest magnitude of float8_e4m3fn: x / scale saturates to it.
constexpr float kFloat8E4M3Max = 448.f;
// Adding and subtracting 1.5 * 2^23 rounds an fp32 of magnitude below 2^22 to an integer,
// ties to even (the default rounding mode), in two adds that vectorise where nearbyint does
// not (SSE2, the portable build's baseline, has no rounding instruction).
constexpr float kRoundingShift = 12582912.f;

// Row `row` (dim elements of dtype) as fp32 in dst: exact for fp32, bf16 and fp16.
void load_row_as_float(const char* row, DType dtype, int64_t dim, float* dst) {
  switch (dtype) {
    case DType::kBFloat16: {
      const auto* in = reinterpret_cast<const c10::BFloat16*>(row);
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(in[d]);
      return;
    }
    case DType::kFloat16: {
      const auto* in = reinterpret_cast<const c10::Half*>(row);
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(in[d]);
      return;
    }
    default: std::memcpy(dst, row, dim * sizeof(float));  // the op layer allows fp32 only else
  }
}

// int8: scale = absmax / 127, stored = clamp(round_half_to_even(x / scale), -127, 127); an
// all-zero row stores zeros with scale 0. The division is IEEE fp32 division (not a multiply
// by the reciprocal), which the Python reference (mha_ext.reference.quantize_int8) matches.
float quantize_int8_row(const float* x, int64_t dim, int8_t* out) {
  float absmax = 0.f;
  for (int64_t d = 0; d < dim; ++d) absmax = std::max(absmax, std::fabs(x[d]));
  const float scale = absmax / 127.f;
  if (scale == 0.f) {
    std::fill(out, out + dim, int8_t(0));
    return scale;
  }
  for (int64_t d = 0; d < dim; ++d) {
    const float rounded = (x[d] / scale + kRoundingShift) - kRoundingShift;
    out[d] = static_cast<int8_t>(std::clamp(rounded, -127.f, 127.f));
  }
  return scale;
}

// float8_e4m3fn: stored = e4m3fn(clamp(x / scale, -448, 448)), c10's conversion (round to
// nearest, ties to even), as torch's .to(torch.float8_e4m3fn) converts. NaN stays NaN.
void quantize_float8_row(const float* x, int64_t dim, float scale, c10::Float8_e4m3fn* out) {
  for (int64_t d = 0; d < dim; ++d) {
    const float y = x[d] / scale;
    out[d] = c10::Float8_e4m3fn(std::isnan(y) ? y : std::clamp(y, -kFloat8E4M3Max, kFloat8E4M3Max));
  }
}

// Writes one (token, kv head) row into its cache row, quantized for an 8-bit cache, and its
// int8 scale at `scale_index`. row: [dim] of p.dtype; buffer: dim fp32 of scratch.
void write_row(const PagedAppendParams& p, const char* row, int64_t dim, char* cache_row,
               const QuantScales& scales, int64_t scale_index, float* buffer) {
  if (p.format == CacheFormat::kPlain) {
    std::memcpy(cache_row, row, dim * p.element_size);
    return;
  }
  load_row_as_float(row, p.dtype, dim, buffer);
  if (p.format == CacheFormat::kInt8) {
    scales.per_row[scale_index] =
        quantize_int8_row(buffer, dim, reinterpret_cast<int8_t*>(cache_row));
  } else {
    quantize_float8_row(buffer, dim, scales.per_tensor,
                        reinterpret_cast<c10::Float8_e4m3fn*>(cache_row));
  }
}

}  // namespace

// Appending copies each (token, kv head) row into its slot, or quantizes it for an 8-bit
// cache: a few operations per element, against the decode step's reads of the whole cache,
// so one portable loop serves every CPU.
void paged_kv_append(const PagedAppendParams& p) {
  const char* key = static_cast<const char*>(p.key);
  const char* value = static_cast<const char*>(p.value);
  char* k_cache = static_cast<char*>(p.k_cache);
  char* v_cache = static_cast<char*>(p.v_cache);
  const int64_t in_bytes = p.element_size;
  const int64_t cache_bytes = p.format == CacheFormat::kPlain ? in_bytes : 1;
  at::parallel_for(0, p.num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(std::max(p.head_dim, p.head_dim_v));
    for (int64_t t = begin; t < end; ++t) {
      if (p.slot_mapping[t] < 0) continue;  // padding token
      const CacheSlot slot = slot_location(p.slot_mapping[t], p.block_size);
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        write_row(p, key + (t * p.key_strides.token + h * p.key_strides.head) * in_bytes,
                  p.head_dim, k_cache + cache_row_offset(p.k_cache_strides, slot, h) * cache_bytes,
                  p.k_scales, cache_row_offset(p.k_scales.strides, slot, h), buffer.data());
        write_row(p, value + (t * p.value_strides.token + h * p.value_strides.head) * in_bytes,
                  p.head_dim_v,
                  v_cache + cache_row_offset(p.v_cache_strides, slot, h) * cache_bytes, p.v_scales,
                  cache_row_offset(p.v_scales.strides, slot, h), buffer.data());
      }
    }
  });
}

}  // namespace mha_ext::cpu
