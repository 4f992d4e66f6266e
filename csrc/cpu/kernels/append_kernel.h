#pragma once
// The CPU append kernel: writes each (token, kv head) key and value row into its cache slot,
// a copy for a plain cache, quantized for an 8-bit one (CacheFormat). Compiled per ISA like
// the attention kernels (kernels_<isa>.cpp): a portable scalar loop quantized a decode step's
// rows (8 tokens x 8 kv heads x D128, bf16) 13x (int8) and 17x (fp8) slower than the bf16
// copy, against issue 33's bound of 2x; the vector paths below compute the same values.
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/parallel.h"
#include "kernel_common.h"
#include "mha_ext/paged_cache.h"
#include "mha_ext/paged_params.h"

namespace mha_ext::cpu {
inline namespace CPU_CAPABILITY {

// Largest magnitude of float8_e4m3fn: x / scale saturates to it.
constexpr float kFloat8E4M3Max = 448.f;
// Adding and subtracting 1.5 * 2^23 rounds an fp32 of magnitude below 2^22 to an integer,
// ties to even (the default rounding mode), in two adds that vectorise where nearbyint does
// not (SSE2, the portable build's baseline, has no rounding instruction).
constexpr float kRoundingShift = 12582912.f;

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
using FloatVec = at::vec::Vectorized<float>;

// The vector helpers of the quantizers, on AVX-512's 16 lanes or AVX2's 8.
#if defined(CPU_CAPABILITY_AVX512)
using IntLanes = __m512i;

// MAXPS returns its second operand where either is NaN: a NaN x leaves acc unchanged, as
// std::max(acc, |x|) does in the scalar loop.
C10_ALWAYS_INLINE FloatVec max_skipping_nan(FloatVec x, FloatVec acc) {
  return _mm512_max_ps(x, acc);
}
// clamp(x, lo, hi) with a NaN x kept NaN (x second in each).
C10_ALWAYS_INLINE FloatVec clamp_keeping_nan(FloatVec x, float lo, float hi) {
  return _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), x));
}
// The largest lane (a tree of maxima: the scalar chain was a row's longest latency).
C10_ALWAYS_INLINE float max_of_lanes(FloatVec x) { return _mm512_reduce_max_ps(x); }
// Whether any lane of x exceeds bound (NaN does not).
C10_ALWAYS_INLINE bool any_above(FloatVec x, float bound) {
  return _mm512_cmp_ps_mask(x, _mm512_set1_ps(bound), _CMP_GT_OQ) != 0;
}
C10_ALWAYS_INLINE IntLanes truncate_to_int(FloatVec x) { return _mm512_cvttps_epi32(x); }
C10_ALWAYS_INLINE IntLanes as_int(FloatVec x) { return _mm512_castps_si512(x); }
C10_ALWAYS_INLINE FloatVec as_float(IntLanes x) { return _mm512_castsi512_ps(x); }
C10_ALWAYS_INLINE IntLanes splat(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
C10_ALWAYS_INLINE IntLanes bit_and(IntLanes a, IntLanes b) { return _mm512_and_si512(a, b); }
C10_ALWAYS_INLINE IntLanes bit_or(IntLanes a, IntLanes b) { return _mm512_or_si512(a, b); }
C10_ALWAYS_INLINE IntLanes bit_xor(IntLanes a, IntLanes b) { return _mm512_xor_si512(a, b); }
C10_ALWAYS_INLINE IntLanes add(IntLanes a, IntLanes b) { return _mm512_add_epi32(a, b); }
C10_ALWAYS_INLINE IntLanes sub(IntLanes a, IntLanes b) { return _mm512_sub_epi32(a, b); }
template <int kBits>
C10_ALWAYS_INLINE IntLanes shift_right(IntLanes a) {
  return _mm512_srli_epi32(a, kBits);
}
// a < b ? if_less : otherwise, as signed 32-bit integers.
C10_ALWAYS_INLINE IntLanes select_less(IntLanes a, IntLanes b, IntLanes if_less,
                                       IntLanes otherwise) {
  return _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(a, b), otherwise, if_less);
}
// The low byte of each of the first `count` lanes to out.
C10_ALWAYS_INLINE void store_low_bytes(IntLanes x, int64_t count, void* out) {
  _mm_mask_storeu_epi8(out, static_cast<__mmask16>((uint32_t(1) << count) - 1),
                       _mm512_cvtepi32_epi8(x));
}
#else
using IntLanes = __m256i;

C10_ALWAYS_INLINE FloatVec max_skipping_nan(FloatVec x, FloatVec acc) {
  return _mm256_max_ps(x, acc);
}
C10_ALWAYS_INLINE FloatVec clamp_keeping_nan(FloatVec x, float lo, float hi) {
  return _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), x));
}
C10_ALWAYS_INLINE float max_of_lanes(FloatVec x) {
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}
C10_ALWAYS_INLINE bool any_above(FloatVec x, float bound) {
  return _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(bound), _CMP_GT_OQ)) != 0;
}
C10_ALWAYS_INLINE IntLanes truncate_to_int(FloatVec x) { return _mm256_cvttps_epi32(x); }
C10_ALWAYS_INLINE IntLanes as_int(FloatVec x) { return _mm256_castps_si256(x); }
C10_ALWAYS_INLINE FloatVec as_float(IntLanes x) { return _mm256_castsi256_ps(x); }
C10_ALWAYS_INLINE IntLanes splat(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
C10_ALWAYS_INLINE IntLanes bit_and(IntLanes a, IntLanes b) { return _mm256_and_si256(a, b); }
C10_ALWAYS_INLINE IntLanes bit_or(IntLanes a, IntLanes b) { return _mm256_or_si256(a, b); }
C10_ALWAYS_INLINE IntLanes bit_xor(IntLanes a, IntLanes b) { return _mm256_xor_si256(a, b); }
C10_ALWAYS_INLINE IntLanes add(IntLanes a, IntLanes b) { return _mm256_add_epi32(a, b); }
C10_ALWAYS_INLINE IntLanes sub(IntLanes a, IntLanes b) { return _mm256_sub_epi32(a, b); }
template <int kBits>
C10_ALWAYS_INLINE IntLanes shift_right(IntLanes a) {
  return _mm256_srli_epi32(a, kBits);
}
C10_ALWAYS_INLINE IntLanes select_less(IntLanes a, IntLanes b, IntLanes if_less,
                                       IntLanes otherwise) {
  return _mm256_blendv_epi8(otherwise, if_less, _mm256_cmpgt_epi32(b, a));
}
C10_ALWAYS_INLINE void store_low_bytes(IntLanes x, int64_t count, void* out) {
  // Each 128-bit half's four low bytes into its low 32 bits (a truncation, like VPMOVDB),
  // then the two halves' together into the low 64 bits.
  const __m256i low_bytes = _mm256_set1_epi64x(0x0C080400);  // bytes 0, 4, 8, 12, then zeros
  const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(x, low_bytes),
                                                     _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
  if (count == 8) {
    _mm_storel_epi64(static_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
  } else {
    uint8_t bytes[8];
    _mm_storel_epi64(reinterpret_cast<__m128i*>(bytes), _mm256_castsi256_si128(packed));
    std::memcpy(out, bytes, count);
  }
}
#endif

// The float8_e4m3fn codes of x, which clamp_keeping_nan bounded to [-448, 448] or NaN: c10's
// conversion (round to nearest, ties to even) lane by lane, its branches as selects.
C10_ALWAYS_INLINE IntLanes float8_e4m3_codes(FloatVec x) {
  const IntLanes sign = bit_and(as_int(x), splat(0x80000000u));
  const IntLanes magnitude = bit_xor(as_int(x), sign);
  // Below 2^-6, the subnormals: adding 2^14 rounds to a multiple of 2^-9 (its ulp), ties to
  // even, and leaves the code in the low bits.
  const IntLanes denorm_bias = splat(141u << 23);  // 2^14
  const IntLanes subnormal = sub(as_int(as_float(magnitude) + as_float(denorm_bias)), denorm_bias);
  // Normals: the exponent rebiased from 127 to 7, the mantissa rounded from 23 to 3 bits, ties
  // to even (a carry goes into the exponent).
  const IntLanes odd = bit_and(shift_right<20>(magnitude), splat(1));
  const IntLanes normal =
      shift_right<20>(add(add(magnitude, splat((uint32_t(7 - 127) << 23) + 0x7FFFFu)), odd));
  const IntLanes finite = select_less(magnitude, splat(121u << 23), subnormal, normal);
  // Bits of 480.0f, the first magnitude e4m3fn cannot hold: only NaN reaches it here.
  const IntLanes code = select_less(magnitude, splat(1087u << 20), finite, splat(0x7F));
  return bit_or(code, shift_right<24>(sign));
}
#endif

// int8: scale = absmax / 127, stored = clamp(round_half_to_even(x / scale), -127, 127); an
// all-zero row stores zeros with scale 0. The division is IEEE fp32 division (not a multiply
// by the reciprocal), which the Python reference (mha_ext.reference.quantize_int8) matches.
template <typename in_t>
float quantize_int8_row(const in_t* x, int64_t dim, int8_t* out) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  constexpr int64_t kWidth = FloatVec::size();
  FloatVec lane_max(0.f);  // lanes past dim load as 0
  for (int64_t d = 0; d < dim; d += kWidth) {
    lane_max = max_skipping_nan(load_as<float>(x + d, std::min(kWidth, dim - d)).abs(), lane_max);
  }
  const float absmax = max_of_lanes(lane_max);
#else
  float absmax = 0.f;
  for (int64_t d = 0; d < dim; ++d) absmax = std::max(absmax, std::fabs(static_cast<float>(x[d])));
#endif
  const float scale = absmax / 127.f;
  if (scale == 0.f) {
    std::fill(out, out + dim, int8_t(0));
    return scale;
  }
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  // A division per element bounded the append (VDIVPS: about a cycle per element here), so
  // the quotient is first estimated as x * (1 / scale), within 3e-5 of the fp32 quotient
  // (2 roundings of relative 2^-24 at magnitudes up to 127): where no lane's estimate lies
  // within 2^-12 of a half-integer, the fp32 quotient rounds to the same integer, and only
  // vectors with such a lane divide. A subnormal scale, whose reciprocal may overflow,
  // divides throughout.
  const bool estimate = scale >= std::numeric_limits<float>::min();
  const FloatVec reciprocal(1.f / scale);
  auto round_to_integer = [](FloatVec y) C10_ALWAYS_INLINE_ATTRIBUTE {
    return (y + FloatVec(kRoundingShift)) - FloatVec(kRoundingShift);
  };
  for (int64_t d = 0; d < dim; d += kWidth) {
    const int64_t count = std::min(kWidth, dim - d);
    const FloatVec row = load_as<float>(x + d, count);
    FloatVec rounded;
    if (estimate) {
      const FloatVec estimated = row * reciprocal;
      rounded = round_to_integer(estimated);
      // |estimate - its integer| is exact in fp32; NaN compares false (and rounds as NaN).
      if (!any_above((estimated - rounded).abs(), 0.5f - 0x1p-12f)) {
        store_low_bytes(truncate_to_int(clamp_keeping_nan(rounded, -127.f, 127.f)), count, out + d);
        continue;
      }
    }
    rounded = round_to_integer(row / FloatVec(scale));
    store_low_bytes(truncate_to_int(clamp_keeping_nan(rounded, -127.f, 127.f)), count, out + d);
  }
#else
  for (int64_t d = 0; d < dim; ++d) {
    const float rounded = (static_cast<float>(x[d]) / scale + kRoundingShift) - kRoundingShift;
    out[d] = static_cast<int8_t>(std::clamp(rounded, -127.f, 127.f));
  }
#endif
  return scale;
}

// float8_e4m3fn: stored = e4m3fn(clamp(x / scale, -448, 448)), c10's conversion (round to
// nearest, ties to even), as torch's .to(torch.float8_e4m3fn) converts. NaN stays NaN.
template <typename in_t>
void quantize_float8_row(const in_t* x, int64_t dim, float scale, c10::Float8_e4m3fn* out) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  constexpr int64_t kWidth = FloatVec::size();
  // Dividing by a power of two and multiplying by its reciprocal, when that is a normal fp32,
  // both give the correctly rounded x * 2^-k: the same bits, without a division per element
  // (VDIVPS, about a cycle per element here). Other scales divide.
  int exponent = 0;
  const bool power_of_two = std::frexp(scale, &exponent) == 0.5f;
  const float reciprocal = 1.f / scale;
  const bool multiply = power_of_two && std::isnormal(scale) && std::isnormal(reciprocal);
  for (int64_t d = 0; d < dim; d += kWidth) {
    const int64_t count = std::min(kWidth, dim - d);
    const FloatVec row = load_as<float>(x + d, count);
    const FloatVec quotient = multiply ? row * FloatVec(reciprocal) : row / FloatVec(scale);
    const FloatVec bounded = clamp_keeping_nan(quotient, -kFloat8E4M3Max, kFloat8E4M3Max);
    store_low_bytes(float8_e4m3_codes(bounded), count, out + d);
  }
#else
  for (int64_t d = 0; d < dim; ++d) {
    const float y = static_cast<float>(x[d]) / scale;
    out[d] = c10::Float8_e4m3fn(std::isnan(y) ? y : std::clamp(y, -kFloat8E4M3Max, kFloat8E4M3Max));
  }
#endif
}

// Writes one (token, kv head) row into its cache row: a copy of dim elements of
// p.element_size bytes for a plain cache; else quantized from in_t (p.dtype), with its int8
// scale at `scale_index`.
template <typename in_t>
void write_row(const PagedAppendParams& p, const char* row, int64_t dim, char* cache_row,
               const QuantScales& scales, int64_t scale_index) {
  const auto* elements = reinterpret_cast<const in_t*>(row);
  switch (p.format) {
    case CacheFormat::kPlain: std::memcpy(cache_row, row, dim * p.element_size); return;
    case CacheFormat::kInt8:
      scales.per_row[scale_index] =
          quantize_int8_row(elements, dim, reinterpret_cast<int8_t*>(cache_row));
      return;
    case CacheFormat::kFloat8E4M3:
      quantize_float8_row(elements, dim, scales.per_tensor,
                          reinterpret_cast<c10::Float8_e4m3fn*>(cache_row));
      return;
  }
}

template <typename in_t>
void paged_kv_append_kernel(const PagedAppendParams& p) {
  const char* key = static_cast<const char*>(p.key);
  const char* value = static_cast<const char*>(p.value);
  char* k_cache = static_cast<char*>(p.k_cache);
  char* v_cache = static_cast<char*>(p.v_cache);
  const int64_t in_bytes = p.element_size;
  const int64_t cache_bytes = p.format == CacheFormat::kPlain ? in_bytes : 1;
  parallel_for(0, p.num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (p.slot_mapping[t] < 0) continue;  // padding token
      const CacheSlot slot = slot_location(p.slot_mapping[t], p.block_size);
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        write_row<in_t>(p, key + (t * p.key_strides.token + h * p.key_strides.head) * in_bytes,
                        p.head_dim,
                        k_cache + cache_row_offset(p.k_cache_strides, slot, h) * cache_bytes,
                        p.k_scales, cache_row_offset(p.k_scales.strides, slot, h));
        write_row<in_t>(
            p, value + (t * p.value_strides.token + h * p.value_strides.head) * in_bytes,
            p.head_dim_v, v_cache + cache_row_offset(p.v_cache_strides, slot, h) * cache_bytes,
            p.v_scales, cache_row_offset(p.v_scales.strides, slot, h));
      }
    }
  });
}

// The keys and values of an 8-bit cache are fp32, bf16 or fp16 (the op layer allows no other
// dtype); a plain cache copies bytes, whatever its dtype.
void paged_kv_append(const PagedAppendParams& p) {
  if (p.format != CacheFormat::kPlain && p.dtype == DType::kBFloat16) {
    return paged_kv_append_kernel<c10::BFloat16>(p);
  }
  if (p.format != CacheFormat::kPlain && p.dtype == DType::kFloat16) {
    return paged_kv_append_kernel<c10::Half>(p);
  }
  paged_kv_append_kernel<float>(p);
}

}  // namespace CPU_CAPABILITY
}  // namespace mha_ext::cpu
