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
// min(x, hi) with a NaN x kept NaN.
C10_ALWAYS_INLINE FloatVec at_most_keeping_nan(FloatVec x, float hi) {
  return _mm512_min_ps(_mm512_set1_ps(hi), x);
}
// Lane r: the largest lane of rows[r]. One transposing tree of maxima for 16 rows (45
// shuffles and maxima, against 8 a row alone and a longer chain of latencies).
C10_ALWAYS_INLINE FloatVec max_of_each(const FloatVec (&rows)[16]) {
  // Each step halves the lanes per row and doubles the rows per vector.
  __m512 pairs[8];  // 128-bit chunks: rows 2i, 2i, 2i + 1, 2i + 1 (4 lanes each)
  for (int i = 0; i < 8; ++i) {
    const __m512 a = rows[2 * i], b = rows[2 * i + 1];
    pairs[i] = _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  __m512 quads[4];  // chunk k: row 4i + k
  for (int i = 0; i < 4; ++i) {
    const __m512 a = pairs[2 * i], b = pairs[2 * i + 1];
    quads[i] = _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  __m512 halves[2];  // chunk k: rows 8i + k and 8i + 4 + k, 2 lanes each
  for (int i = 0; i < 2; ++i) {
    const __m512 a = quads[2 * i], b = quads[2 * i + 1];
    halves[i] = _mm512_max_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // lane 4k + j: row 4j + k
  const __m512 maxima =
      _mm512_max_ps(_mm512_shuffle_ps(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                    _mm512_shuffle_ps(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i row_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(row_order, maxima);
}
C10_ALWAYS_INLINE IntLanes truncate_to_int(FloatVec x) { return _mm512_cvttps_epi32(x); }
C10_ALWAYS_INLINE IntLanes as_int(FloatVec x) { return _mm512_castps_si512(x); }
C10_ALWAYS_INLINE FloatVec as_float(IntLanes x) { return _mm512_castsi512_ps(x); }
C10_ALWAYS_INLINE IntLanes splat(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
C10_ALWAYS_INLINE IntLanes bit_and(IntLanes a, IntLanes b) { return _mm512_and_si512(a, b); }
C10_ALWAYS_INLINE IntLanes bit_or(IntLanes a, IntLanes b) { return _mm512_or_si512(a, b); }
C10_ALWAYS_INLINE IntLanes add(IntLanes a, IntLanes b) { return _mm512_add_epi32(a, b); }
C10_ALWAYS_INLINE IntLanes sub(IntLanes a, IntLanes b) { return _mm512_sub_epi32(a, b); }
// The larger and the smaller, as signed 32-bit integers.
C10_ALWAYS_INLINE IntLanes max_int(IntLanes a, IntLanes b) { return _mm512_max_epi32(a, b); }
C10_ALWAYS_INLINE IntLanes min_int(IntLanes a, IntLanes b) { return _mm512_min_epi32(a, b); }
template <int kBits>
C10_ALWAYS_INLINE IntLanes shift_right(IntLanes a) {
  return _mm512_srli_epi32(a, kBits);
}
template <int kBits>
C10_ALWAYS_INLINE IntLanes shift_left(IntLanes a) {
  return _mm512_slli_epi32(a, kBits);
}
// The bits of if_set where mask has a 1, the bits of otherwise elsewhere.
C10_ALWAYS_INLINE IntLanes select_bits(IntLanes mask, IntLanes if_set, IntLanes otherwise) {
  return _mm512_ternarylogic_epi32(mask, if_set, otherwise, 0xCA);  // mask ? if_set : otherwise
}
// Whether any lane of a exceeds bound's, as signed 32-bit integers.
C10_ALWAYS_INLINE bool any_above(IntLanes a, IntLanes bound) {
  return _mm512_cmpgt_epi32_mask(a, bound) != 0;
}
// The 16-bit halves of 32-bit lanes: the larger of a's and b's signed halves, each half on its
// own; whether any half of a, signed, exceeds bound.
C10_ALWAYS_INLINE IntLanes max_int16(IntLanes a, IntLanes b) { return _mm512_max_epi16(a, b); }
C10_ALWAYS_INLINE bool any_int16_above(IntLanes a, int16_t bound) {
  return _mm512_cmpgt_epi16_mask(a, _mm512_set1_epi16(bound)) != 0;
}
// Each 32-bit lane's low half from low, its high half from high.
C10_ALWAYS_INLINE IntLanes join_halves(IntLanes low, IntLanes high) {
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, low, high);
}
// The low bytes of two vectors' 16-bit halves, in order, in one store: each an integer in
// [-128, 127] (kUnsigned: in [0, 255]). The pack interleaves the vectors' 128-bit chunks (8
// bytes of words[0], then 8 of words[1]), which one permute of 64-bit words undoes.
template <bool kUnsigned>
C10_ALWAYS_INLINE void store_low_bytes_of_halves(const IntLanes (&words)[2], void* out) {
  const __m512i bytes =
      kUnsigned ? _mm512_packus_epi16(words[0], words[1]) : _mm512_packs_epi16(words[0], words[1]);
  const __m512i in_order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  _mm512_storeu_si512(out, _mm512_permutexvar_epi64(in_order, bytes));
}
// The low byte of each of the first `count` lanes to out.
C10_ALWAYS_INLINE void store_low_bytes(IntLanes x, int64_t count, void* out) {
  _mm_mask_storeu_epi8(out, static_cast<__mmask16>((uint32_t(1) << count) - 1),
                       _mm512_cvtepi32_epi8(x));
}
// The lanes of four vectors, each an integer in [-128, 127] (kUnsigned: in [0, 255]), as bytes in
// one store: 4 x 16 in order. The packs work within 128-bit chunks, leaving 32-bit word 4j + i
// of their result with chunk j of x[i], and one permute puts those words in order. Storing
// each vector's low bytes takes two uops and a store per vector on Intel cores; this, four
// shuffles and one store for the four.
template <bool kUnsigned = false>
C10_ALWAYS_INLINE void store_bytes_of_4(const IntLanes (&x)[4], void* out) {
  const __m512i words[2] = {_mm512_packs_epi32(x[0], x[1]), _mm512_packs_epi32(x[2], x[3])};
  const __m512i bytes =
      kUnsigned ? _mm512_packus_epi16(words[0], words[1]) : _mm512_packs_epi16(words[0], words[1]);
  const __m512i in_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_si512(out, _mm512_permutexvar_epi32(in_order, bytes));
}
#else
using IntLanes = __m256i;

C10_ALWAYS_INLINE FloatVec max_skipping_nan(FloatVec x, FloatVec acc) {
  return _mm256_max_ps(x, acc);
}
C10_ALWAYS_INLINE FloatVec clamp_keeping_nan(FloatVec x, float lo, float hi) {
  return _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), x));
}
C10_ALWAYS_INLINE FloatVec at_most_keeping_nan(FloatVec x, float hi) {
  return _mm256_min_ps(_mm256_set1_ps(hi), x);
}
C10_ALWAYS_INLINE FloatVec max_of_each(const FloatVec (&rows)[8]) {
  __m256 pairs[4];  // 128-bit halves: rows 2i and 2i + 1
  for (int i = 0; i < 4; ++i) {
    const __m256 a = rows[2 * i], b = rows[2 * i + 1];
    pairs[i] =
        _mm256_max_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  __m256 quads[2];  // half k: rows 4i + k and 4i + 2 + k, 2 lanes each
  for (int i = 0; i < 2; ++i) {
    const __m256 a = pairs[2 * i], b = pairs[2 * i + 1];
    quads[i] = _mm256_max_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // lane 4k + j: row 2j + k
  const __m256 maxima =
      _mm256_max_ps(_mm256_shuffle_ps(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                    _mm256_shuffle_ps(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(maxima, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
C10_ALWAYS_INLINE IntLanes truncate_to_int(FloatVec x) { return _mm256_cvttps_epi32(x); }
C10_ALWAYS_INLINE IntLanes as_int(FloatVec x) { return _mm256_castps_si256(x); }
C10_ALWAYS_INLINE FloatVec as_float(IntLanes x) { return _mm256_castsi256_ps(x); }
C10_ALWAYS_INLINE IntLanes splat(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
C10_ALWAYS_INLINE IntLanes bit_and(IntLanes a, IntLanes b) { return _mm256_and_si256(a, b); }
C10_ALWAYS_INLINE IntLanes bit_or(IntLanes a, IntLanes b) { return _mm256_or_si256(a, b); }
C10_ALWAYS_INLINE IntLanes add(IntLanes a, IntLanes b) { return _mm256_add_epi32(a, b); }
C10_ALWAYS_INLINE IntLanes sub(IntLanes a, IntLanes b) { return _mm256_sub_epi32(a, b); }
C10_ALWAYS_INLINE IntLanes max_int(IntLanes a, IntLanes b) { return _mm256_max_epi32(a, b); }
C10_ALWAYS_INLINE IntLanes min_int(IntLanes a, IntLanes b) { return _mm256_min_epi32(a, b); }
template <int kBits>
C10_ALWAYS_INLINE IntLanes shift_right(IntLanes a) {
  return _mm256_srli_epi32(a, kBits);
}
template <int kBits>
C10_ALWAYS_INLINE IntLanes shift_left(IntLanes a) {
  return _mm256_slli_epi32(a, kBits);
}
C10_ALWAYS_INLINE IntLanes select_bits(IntLanes mask, IntLanes if_set, IntLanes otherwise) {
  return _mm256_or_si256(_mm256_and_si256(mask, if_set), _mm256_andnot_si256(mask, otherwise));
}
C10_ALWAYS_INLINE bool any_above(IntLanes a, IntLanes bound) {
  return _mm256_movemask_epi8(_mm256_cmpgt_epi32(a, bound)) != 0;
}
C10_ALWAYS_INLINE IntLanes max_int16(IntLanes a, IntLanes b) { return _mm256_max_epi16(a, b); }
C10_ALWAYS_INLINE bool any_int16_above(IntLanes a, int16_t bound) {
  return _mm256_movemask_epi8(_mm256_cmpgt_epi16(a, _mm256_set1_epi16(bound))) != 0;
}
C10_ALWAYS_INLINE IntLanes join_halves(IntLanes low, IntLanes high) {
  return _mm256_blend_epi16(low, high, 0xAA);
}
// (see the AVX-512 version; here the 128-bit chunks' 64-bit words go back in order)
template <bool kUnsigned>
C10_ALWAYS_INLINE void store_low_bytes_of_halves(const IntLanes (&words)[2], void* out) {
  const __m256i bytes =
      kUnsigned ? _mm256_packus_epi16(words[0], words[1]) : _mm256_packs_epi16(words[0], words[1]);
  _mm256_storeu_si256(static_cast<__m256i*>(out), _mm256_permute4x64_epi64(bytes, 0xD8));
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
// 4 x 8 lanes, each an integer in [-128, 127] (kUnsigned: in [0, 255]), as bytes in order (see
// the AVX-512 version).
template <bool kUnsigned = false>
C10_ALWAYS_INLINE void store_bytes_of_4(const IntLanes (&x)[4], void* out) {
  const __m256i words[2] = {_mm256_packs_epi32(x[0], x[1]), _mm256_packs_epi32(x[2], x[3])};
  const __m256i bytes =
      kUnsigned ? _mm256_packus_epi16(words[0], words[1]) : _mm256_packs_epi16(words[0], words[1]);
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(static_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(bytes, in_order));
}
#endif

// The float8_e4m3fn codes of min(m, 448) for magnitudes m (sign bit clear; NaN stays NaN), in
// each lane's low 7 bits: rounded to nearest, ties to even, as c10 converts.
//
// m is bounded first: to 448 by MINPS, which passes a NaN (its second operand), then a NaN to
// 480 by an integer minimum (non-negative floats order as their bits do); 480 encodes below as
// 0x7F, e4m3fn's NaN. m in [2^e, 2^(e + 1)) plus s = 2^(e + 20) is s plus a whole number of
// s's units in the last place, 2^(e - 3): fp32's own rounding (to nearest, ties to even)
// rounds m to e4m3's 3 mantissa bits, and the sum's bits minus s's count the units, 8..16 (16:
// a tie carried into 2^(e + 1), as in e4m3). Below 2^-6, e4m3's subnormals, e stays -6: units
// of 2^-9, 0..8. The code is then 8 * (e + 6) + units. Bounding the magnitude rather than x
// drops the clamp's lower bound, the NaN check and the shifter's sign.
C10_ALWAYS_INLINE IntLanes float8_e4m3_magnitude_codes(FloatVec magnitude) {
  const IntLanes bounded =
      min_int(as_int(at_most_keeping_nan(magnitude, kFloat8E4M3Max)), splat(0x43F00000u));  // 480
  // 2^e's bits, e >= -6
  const IntLanes power = max_int(bit_and(bounded, splat(0x7F800000u)), splat(121u << 23));
  const IntLanes shifter = add(power, splat(20u << 23));
  const IntLanes units = sub(as_int(as_float(bounded) + as_float(shifter)), shifter);
  // 8 * (e + 6) = (bits of 2^e >> 20) - 8 * 121
  return add(units, sub(shift_right<20>(power), splat(8 * 121)));
}

// The float8_e4m3fn codes of clamp(x, -448, 448) (each lane's low byte): the magnitude's code
// with x's sign as bit 7 (which the code leaves 0: its exponent is at most 15). -0 and
// negatives rounding to zero keep the sign, as in c10.
C10_ALWAYS_INLINE IntLanes float8_e4m3_codes(FloatVec x) {
  const FloatVec magnitude = as_float(bit_and(as_int(x), splat(0x7FFFFFFFu)));
  return select_bits(splat(0x80), shift_right<24>(as_int(x)),
                     float8_e4m3_magnitude_codes(magnitude));
}
#endif

// int8: scale = absmax / 127, stored = clamp(round_half_to_even(x / scale), -127, 127); an
// all-zero row stores zeros with scale 0. The division is IEEE fp32 division (not a multiply
// by the reciprocal), which the Python reference (mha_ext.reference.quantize_int8) matches.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The lane maxima of |x| over a row of dim elements (lanes past dim 0, NaN skipped).
template <typename in_t>
C10_ALWAYS_INLINE FloatVec lane_absmax(const in_t* x, int64_t dim) {
  constexpr int64_t kWidth = FloatVec::size();
  FloatVec lane_max(0.f);
  int64_t d = 0;
  if constexpr (std::is_same_v<in_t, c10::BFloat16>) {
    // bf16 magnitudes order as their bits do, so a 16-bit integer maximum takes two vectors'
    // elements at a time, unwidened. A NaN's bits exceed every number's: a row with one goes
    // through the fp32 loop below, which skips NaNs.
    IntLanes max_bits = splat(0);
    for (; d + 2 * kWidth <= dim; d += 2 * kWidth) {
      max_bits = max_int16(max_bits, bit_and(load_bf16_pairs(x + d), splat(0x7FFF7FFFu)));
    }
    if (any_int16_above(max_bits, 0x7F80)) {
      d = 0;
    } else {
      lane_max = max_skipping_nan(even_bf16_elements(max_bits), odd_bf16_elements(max_bits));
    }
  }
  for (; d + kWidth <= dim; d += kWidth) {
    lane_max = max_skipping_nan(load_as<float>(x + d, kWidth).abs(), lane_max);
  }
  if (d < dim) lane_max = max_skipping_nan(load_as<float>(x + d, dim - d).abs(), lane_max);
  return lane_max;
}

// x * (1 / scale) rounded to an integer, the estimate of the quotient (see quantize_int8_row):
// adding 1.5 * 2^23 rounds to an integer (ties to even), which the sum's bits minus those of
// 1.5 * 2^23 then hold exactly (|estimate| < 2^22). Raises each lane of farthest to the bits
// of |estimate - its integer| (exact in fp32), whose order is the numbers' with NaN's above
// them all: one integer maximum per vector, and one compare for several (needs_division).
C10_ALWAYS_INLINE IntLanes estimated_quotient(FloatVec x, float reciprocal, IntLanes& farthest) {
  const FloatVec estimated = x * FloatVec(reciprocal);
  const FloatVec shifted = estimated + FloatVec(kRoundingShift);
  farthest = max_int(farthest, as_int((estimated - (shifted - FloatVec(kRoundingShift))).abs()));
  return sub(as_int(shifted), as_int(FloatVec(kRoundingShift)));
}

// Whether a lane of the estimates behind farthest lies within 2^-12 of a half-integer, or is
// NaN: those need the division.
C10_ALWAYS_INLINE bool needs_division(IntLanes farthest) {
  return any_above(farthest, as_int(FloatVec(0.5f - 0x1p-12f)));
}

// Quantizes count (<= a vector's width) elements of a row; see quantize_int8_row.
template <typename in_t>
C10_ALWAYS_INLINE void quantize_int8_vector(const in_t* x, int64_t count, float scale,
                                            float reciprocal, bool estimate, int8_t* out) {
  const FloatVec row = load_as<float>(x, count);
  if (estimate) {
    IntLanes farthest = splat(0);
    const IntLanes quotient = estimated_quotient(row, reciprocal, farthest);
    if (!needs_division(farthest)) {
      store_low_bytes(quotient, count, out);
      return;
    }
  }
  const FloatVec rounded =
      (row / FloatVec(scale) + FloatVec(kRoundingShift)) - FloatVec(kRoundingShift);
  store_low_bytes(truncate_to_int(clamp_keeping_nan(rounded, -127.f, 127.f)), count, out);
}

// Stores a row quantized with its scale (absmax / 127) and reciprocal (1 / scale, both
// computed in fp32).
template <typename in_t>
C10_ALWAYS_INLINE void quantize_int8_row(const in_t* x, int64_t dim, float scale, float reciprocal,
                                         int8_t* out) {
  constexpr int64_t kWidth = FloatVec::size();
  if (scale == 0.f) {
    std::fill(out, out + dim, int8_t(0));
    return;
  }
  // A division per element bounded the append (VDIVPS: about a cycle per element here), so
  // the quotient is first estimated as x * (1 / scale), within 3e-5 of the fp32 quotient
  // (2 roundings of relative 2^-24 at magnitudes up to 127): where no lane's estimate lies
  // within 2^-12 of a half-integer, the fp32 quotient rounds to the same integer, and only
  // vectors with such a lane divide. A normal scale puts the estimate within
  // 127 * (1 + 2^-22) of 0, so it needs no clamp (a row with an infinity has scale inf:
  // estimates 0, or NaN for the infinity). A subnormal scale, whose reciprocal may overflow,
  // divides throughout.
  const bool estimate = scale >= std::numeric_limits<float>::min();
  int64_t d = 0;
  // Four vectors at a time, stored together where none of their lanes needs the division:
  // against a vector at a time, each storing its own low bytes, 0.82-0.86 -> 0.72-0.76 us per
  // token for a decode step's append (8 sequences x 8 kv heads x D128 bf16, one thread, Xeon
  // model 207), 0.55-0.58 -> 0.46-0.48 at 16 tokens per sequence. bf16 rows widen in pairs
  // (even_bf16_elements), and each pair's two quotients join as 16-bit halves in order; with the
  // bf16 absmax in 16-bit integers (lane_absmax), the same harness as the fp8 append's below
  // (Xeon model 167): 0.84-0.86 -> 0.66-0.72 us per token at MHA_EXT_CPU_ISA=avx2 (2.2x ->
  // 1.8x the bf16 append), 0.66-0.71 -> 0.62-0.64 at avx512_amx.
  for (; estimate && d + 4 * kWidth <= dim; d += 4 * kWidth) {
    IntLanes farthest = splat(0);
    if constexpr (std::is_same_v<in_t, c10::BFloat16>) {
      IntLanes words[2];
      for (int i = 0; i < 2; ++i) {
        const IntLanes pairs = load_bf16_pairs(x + d + 2 * i * kWidth);
        const IntLanes even = estimated_quotient(even_bf16_elements(pairs), reciprocal, farthest);
        const IntLanes odd = estimated_quotient(odd_bf16_elements(pairs), reciprocal, farthest);
        words[i] = join_halves(even, shift_left<16>(odd));
      }
      if (!needs_division(farthest)) {
        store_low_bytes_of_halves<false>(words, out + d);
        continue;
      }
    } else {
      IntLanes quotients[4];
      for (int i = 0; i < 4; ++i) {
        quotients[i] =
            estimated_quotient(load_as<float>(x + d + i * kWidth, kWidth), reciprocal, farthest);
      }
      if (!needs_division(farthest)) {
        store_bytes_of_4(quotients, out + d);
        continue;
      }
    }
    for (int i = 0; i < 4; ++i) {
      quantize_int8_vector(x + d + i * kWidth, kWidth, scale, reciprocal, estimate,
                           out + d + i * kWidth);
    }
  }
  for (; d < dim; d += kWidth) {
    quantize_int8_vector(x + d, std::min(kWidth, dim - d), scale, reciprocal, estimate, out + d);
  }
}
#else
template <typename in_t>
float quantize_int8_row(const in_t* x, int64_t dim, int8_t* out) {
  float absmax = 0.f;
  for (int64_t d = 0; d < dim; ++d) absmax = std::max(absmax, std::fabs(static_cast<float>(x[d])));
  const float scale = absmax / 127.f;
  for (int64_t d = 0; d < dim; ++d) {
    const float rounded =
        scale == 0.f ? 0.f : (static_cast<float>(x[d]) / scale + kRoundingShift) - kRoundingShift;
    out[d] = static_cast<int8_t>(std::clamp(rounded, -127.f, 127.f));
  }
  return scale;
}
#endif

// One int8 row of a token: where it comes from and where it and its scale go.
template <typename in_t>
struct Int8Row {
  const in_t* in;
  int64_t dim;
  int8_t* out;
  float* scale;
};

// The kv heads [begin, end) of one token: the rows one task of the append writes.
struct HeadRange {
  int64_t begin;
  int64_t end;
  int64_t size() const { return end - begin; }
};

// Row r of token t's heads `heads`, whose slot is `slot`: the key of kv head heads.begin + r,
// or for r >= heads.size() the value of kv head heads.begin + r - heads.size().
template <typename in_t>
C10_ALWAYS_INLINE Int8Row<in_t> int8_row(const PagedAppendParams& p, int64_t t, CacheSlot slot,
                                         HeadRange heads, int64_t r) {
  const bool is_key = r < heads.size();
  const int64_t h = heads.begin + (is_key ? r : r - heads.size());
  const TokenStrides& in_strides = is_key ? p.key_strides : p.value_strides;
  const QuantScales& scales = is_key ? p.k_scales : p.v_scales;
  const auto* in = static_cast<const in_t*>(is_key ? p.key : p.value);
  auto* cache = static_cast<int8_t*>(is_key ? p.k_cache : p.v_cache);
  return {in + t * in_strides.token + h * in_strides.head, is_key ? p.head_dim : p.head_dim_v,
          cache + cache_row_offset(is_key ? p.k_cache_strides : p.v_cache_strides, slot, h),
          scales.per_row + cache_row_offset(scales.strides, slot, h)};
}

// The 2 * heads.size() int8 rows of token t's heads. On the vector ISAs a vector's width of
// rows at a time: their lane maxima reduce together into one vector of absmaxes, and one
// division each gives their scales and the reciprocals; a row at a time, the reduction and two
// scalar divisions made a chain of latencies longer than the row's quantizing.
template <typename in_t>
void append_int8_rows(const PagedAppendParams& p, int64_t t, CacheSlot slot, HeadRange heads) {
  const int64_t rows = 2 * heads.size();
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  constexpr int64_t kGroup = FloatVec::size();
  for (int64_t first = 0; first < rows; first += kGroup) {
    const int64_t count = std::min(kGroup, rows - first);
    FloatVec lane_max[kGroup];
    for (int64_t r = 0; r < kGroup; ++r) {
      const Int8Row<in_t> row = int8_row<in_t>(p, t, slot, heads, first + std::min(r, count - 1));
      lane_max[r] = r < count ? lane_absmax(row.in, row.dim) : FloatVec(0.f);
    }
    const FloatVec scales = max_of_each(lane_max) / FloatVec(127.f);
    alignas(64) float scale[kGroup];
    alignas(64) float reciprocal[kGroup];
    scales.store(scale);
    (FloatVec(1.f) / scales).store(reciprocal);
    for (int64_t r = 0; r < count; ++r) {
      const Int8Row<in_t> row = int8_row<in_t>(p, t, slot, heads, first + r);
      quantize_int8_row(row.in, row.dim, scale[r], reciprocal[r], row.out);
      *row.scale = scale[r];
    }
  }
#else
  for (int64_t r = 0; r < rows; ++r) {
    const Int8Row<in_t> row = int8_row<in_t>(p, t, slot, heads, r);
    *row.scale = quantize_int8_row(row.in, row.dim, row.out);
  }
#endif
}

// float8_e4m3fn: stored = e4m3fn(clamp(x / scale, -448, 448)), c10's conversion (round to
// nearest, ties to even), as torch's .to(torch.float8_e4m3fn) converts. NaN stays NaN.
//
// How a cache tensor's rows are divided by its scale, decided once per call (frexp and a
// division per row were a third of a row's cost): dividing by a power of two and multiplying
// by its reciprocal, when that is a normal fp32, both give the correctly rounded x * 2^-k, the
// same bits without a division per element (VDIVPS, about a cycle per element here). Other
// scales divide, and scale 1 (the default) does neither. Each way has its own row loop.
enum class Float8Division { kNone, kByReciprocal, kByScale };

struct Float8Divisor {
  float scale;
  float reciprocal;
  Float8Division how;
};

inline Float8Divisor float8_divisor(float scale) {
  int exponent = 0;
  const bool power_of_two = std::frexp(scale, &exponent) == 0.5f;
  const float reciprocal = 1.f / scale;
  const Float8Division how = scale == 1.f ? Float8Division::kNone
                             : power_of_two && std::isnormal(scale) && std::isnormal(reciprocal)
                                 ? Float8Division::kByReciprocal
                                 : Float8Division::kByScale;
  return {scale, reciprocal, how};
}

template <Float8Division kHow, typename in_t>
C10_ALWAYS_INLINE void quantize_float8_row(const in_t* x, int64_t dim, Float8Divisor divisor,
                                           c10::Float8_e4m3fn* out) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  constexpr int64_t kWidth = FloatVec::size();
  const auto quotient = [&](const FloatVec& row) {
    if constexpr (kHow == Float8Division::kNone) return row;
    if constexpr (kHow == Float8Division::kByReciprocal) return row * FloatVec(divisor.reciprocal);
    if constexpr (kHow == Float8Division::kByScale) return row / FloatVec(divisor.scale);
  };
  int64_t d = 0;
  if constexpr (std::is_same_v<in_t, c10::BFloat16>) {
    // Widened in pairs (even_bf16_elements) from their magnitudes' bits; each pair's codes join as
    // 16-bit halves in order, the elements' signs taken from their bits. Against the loop
    // below (a shuffle and a shift per vector to widen, the sign joined per vector): a decode
    // step's append (8 sequences x 8 kv heads x D128 bf16, one thread, Xeon model 167, a
    // harness timing 400-call runs of paged_kv_append, builds alternated) 0.93-0.96 ->
    // 0.75-0.79 us per token at MHA_EXT_CPU_ISA=avx2 (2.4x -> 2.0x the bf16 append), 0.73-0.74
    // -> 0.56-0.64 at avx512_amx; and without the multiply at scale 1 (kNone) 0.71 and
    // 0.56-0.58.
    for (; d + 4 * kWidth <= dim; d += 4 * kWidth) {
      IntLanes words[2];
      for (int i = 0; i < 2; ++i) {
        const IntLanes pairs = load_bf16_pairs(x + d + 2 * i * kWidth);
        const IntLanes magnitudes = bit_and(pairs, splat(0x7FFF7FFFu));
        const IntLanes even = float8_e4m3_magnitude_codes(quotient(even_bf16_elements(magnitudes)));
        const IntLanes odd = float8_e4m3_magnitude_codes(quotient(odd_bf16_elements(magnitudes)));
        const IntLanes signs = bit_and(shift_right<8>(pairs), splat(0x00800080u));  // bits 7, 23
        words[i] = bit_or(bit_or(even, shift_left<16>(odd)), signs);
      }
      store_low_bytes_of_halves<true>(words, out + d);
    }
  }
  for (; d + 4 * kWidth <= dim; d += 4 * kWidth) {
    IntLanes codes[4];
    for (int i = 0; i < 4; ++i)
      codes[i] = float8_e4m3_codes(quotient(load_as<float>(x + d + i * kWidth, kWidth)));
    store_bytes_of_4<true>(codes, out + d);
  }
  for (; d < dim; d += kWidth) {
    const int64_t count = std::min(kWidth, dim - d);
    store_low_bytes(float8_e4m3_codes(quotient(load_as<float>(x + d, count))), count, out + d);
  }
#else
  for (int64_t d = 0; d < dim; ++d) {
    const float y = static_cast<float>(x[d]) / divisor.scale;
    out[d] = c10::Float8_e4m3fn(std::isnan(y) ? y : std::clamp(y, -kFloat8E4M3Max, kFloat8E4M3Max));
  }
#endif
}

// Writes one (token, kv head) row into its cache row: a copy of dim elements of
// p.element_size bytes for a plain cache, or quantized from in_t (p.dtype) into a float8_e4m3fn
// one by its per-tensor scale.
template <typename in_t>
C10_ALWAYS_INLINE void write_row(const PagedAppendParams& p, const char* row, int64_t dim,
                                 char* cache_row, Float8Divisor divisor) {
  if (p.format == CacheFormat::kPlain) {
    std::memcpy(cache_row, row, dim * p.element_size);
    return;
  }
  const auto* in = reinterpret_cast<const in_t*>(row);
  auto* out = reinterpret_cast<c10::Float8_e4m3fn*>(cache_row);
  switch (divisor.how) {
    case Float8Division::kNone:
      return quantize_float8_row<Float8Division::kNone>(in, dim, divisor, out);
    case Float8Division::kByReciprocal:
      return quantize_float8_row<Float8Division::kByReciprocal>(in, dim, divisor, out);
    case Float8Division::kByScale:
      return quantize_float8_row<Float8Division::kByScale>(in, dim, divisor, out);
  }
}

// The kv heads of one task: as many as the int8 quantizer groups (a vector's width of rows, a
// key and a value row per head), so that tasks split no group.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kAppendTaskHeads = FloatVec::size() / 2;
#else
constexpr int64_t kAppendTaskHeads = 8;
#endif

// The work below which an append runs on the calling thread, in bytes of a plain copy (a
// quantized element counts as 8: quantizing a bf16 element cost about four times copying it).
// A second thread pays where its share outweighs waking it: a decode step of 8 sequences (D128,
// bf16 rows), us per token on one thread against two (Zen 4, a harness alternating
// torch.set_num_threads(1) and (2) around runs of 200 appends): int8 at 8 / 16 / 32 kv heads
// 0.55 / 0.89 / 1.51 -> 0.52 / 0.70 / 0.99, bf16 at 32 kv heads 0.63 -> 0.57; but int8 at 8 kv
// heads in kv_cache_speed.py's flatness rounds (appends back to back) 0.57 -> 0.82.
// Check: python benchmarks/kv_cache_speed.py --rounds 7 --formats bf16 int8 fp8 [--heads 32
// --kv-heads 32]
constexpr int64_t kParallelAppendBytes = 256 * 1024;

template <typename in_t>
void paged_kv_append_kernel(const PagedAppendParams& p) {
  const char* key = static_cast<const char*>(p.key);
  const char* value = static_cast<const char*>(p.value);
  char* k_cache = static_cast<char*>(p.k_cache);
  char* v_cache = static_cast<char*>(p.v_cache);
  const int64_t in_bytes = p.element_size;
  const int64_t cache_bytes = p.format == CacheFormat::kPlain ? in_bytes : 1;
  const Float8Divisor k_divisor = float8_divisor(p.k_scales.per_tensor);
  const Float8Divisor v_divisor = float8_divisor(p.v_scales.per_tensor);
  const int64_t tasks_per_token = ceil_div(p.num_kv_heads, kAppendTaskHeads);
  const int64_t tasks = p.num_tokens * tasks_per_token;
  const int64_t work = p.num_tokens * p.num_kv_heads * (p.head_dim + p.head_dim_v) *
                       (p.format == CacheFormat::kPlain ? in_bytes : 8);
  parallel_for(0, tasks, work < kParallelAppendBytes ? tasks : 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / tasks_per_token;
      if (p.slot_mapping[t] < 0) continue;  // padding token
      const CacheSlot slot = slot_location(p.slot_mapping[t], p.block_size);
      const int64_t first_head = task % tasks_per_token * kAppendTaskHeads;
      const HeadRange heads{first_head, std::min(first_head + kAppendTaskHeads, p.num_kv_heads)};
      if (p.format == CacheFormat::kInt8) {
        append_int8_rows<in_t>(p, t, slot, heads);
        continue;
      }
      for (int64_t h = heads.begin; h < heads.end; ++h) {
        write_row<in_t>(
            p, key + (t * p.key_strides.token + h * p.key_strides.head) * in_bytes, p.head_dim,
            k_cache + cache_row_offset(p.k_cache_strides, slot, h) * cache_bytes, k_divisor);
        write_row<in_t>(
            p, value + (t * p.value_strides.token + h * p.value_strides.head) * in_bytes,
            p.head_dim_v, v_cache + cache_row_offset(p.v_cache_strides, slot, h) * cache_bytes,
            v_divisor);
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
