#pragma once
// float8_e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities, NaN =
// S.1111.111, largest finite 448) by bit manipulation, for host and device code that cannot
// use c10's type (the CUDA kernels). Conversions round to nearest, ties to even, as c10's.
#include <cstdint>
#include <cstring>

#include "mha_ext/macros.h"

namespace mha_ext {

// A float8_e4m3fn element of a cache, by its bits.
struct Float8E4M3 {
  uint8_t bits;
};

MHA_EXT_BEGIN_ISA_NAMESPACE

MHA_EXT_HOST_DEVICE uint32_t float_bits(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  return bits;
}

MHA_EXT_HOST_DEVICE float float_from_bits(uint32_t bits) {
  float x;
  memcpy(&x, &bits, sizeof(x));
  return x;
}

// The e4m3fn value of `bits` as fp32 (exact: every e4m3fn value is an fp32).
MHA_EXT_HOST_DEVICE float e4m3fn_to_float(uint8_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x80) << 24;
  const uint32_t exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
  if ((bits & 0x7F) == 0x7F) return float_from_bits(sign | 0x7FC00000u);  // NaN
  if (exponent == 0) {  // subnormal: mantissa x 2^-9
    const float magnitude = static_cast<float>(mantissa) * (1.f / 512.f);
    return sign != 0 ? -magnitude : magnitude;
  }
  // Rebias the exponent from 7 to 127 and widen the mantissa from 3 bits to 23.
  return float_from_bits(sign | ((exponent + 120) << 23) | (mantissa << 20));
}

// The e4m3fn nearest to x (ties to even); x must lie within +-448 or be NaN (callers
// saturate first).
MHA_EXT_HOST_DEVICE uint8_t float_to_e4m3fn(float x) {
  uint32_t bits = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  bits &= 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7F);  // NaN
  if (bits < (121u << 23)) {
    // Below 2^-6, e4m3's subnormals, multiples of 2^-9: adding 2^14 leaves a sum whose last
    // mantissa bit is worth 2^-9, so the add rounds to that grid (ties to even) and the
    // sum's low bits are the multiple.
    const float aligned = float_from_bits(bits) + float_from_bits(141u << 23);
    return static_cast<uint8_t>(sign | (float_bits(aligned) - (141u << 23)));
  }
  // Normal: round the 23-bit mantissa to 3 bits, ties to even, carrying into the exponent,
  // then rebias the exponent from 127 to 7.
  const uint32_t odd = (bits >> 20) & 1u;
  bits += (1u << 19) - 1u + odd;
  return static_cast<uint8_t>(sign | ((bits - (120u << 23)) >> 20));
}

MHA_EXT_END_ISA_NAMESPACE

}  // namespace mha_ext
