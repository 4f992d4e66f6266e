#pragma once
// Pieces shared by the CPU kernels: per-thread scratch, tile loads and stores, the
// online-softmax step and the dtype switch. Accumulation types: mha_ext/accumulate_type.h.
//
// Included by an ISA translation unit after it defines CPU_CAPABILITY.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "blocking.h"
#include "cpu/isa.h"
#include "mha_ext/accumulate_type.h"
#include "mha_ext/attention_params.h"

namespace mha_ext::cpu {
inline namespace CPU_CAPABILITY {

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Per-thread scratch that outlives calls: memory touched for the first time is slow on
// these machines, so each thread keeps its buffer and only ever grows it. The buffer starts
// on a 64-byte cache line: AMX tile loads and stores of rows that straddle two lines made
// the bf16 forward 1.3x slower in every process whose malloc returned an address off a line.
template <typename T>
T* thread_scratch(int64_t elements) {
  struct Free {
    void operator()(T* data) const { std::free(data); }
  };
  constexpr size_t kLine = 64;
  thread_local std::unique_ptr<T[], Free> buffer;
  thread_local int64_t capacity = 0;
  if (capacity < elements) {
    const size_t bytes = (elements * sizeof(T) + kLine - 1) / kLine * kLine;
    buffer.reset(static_cast<T*>(std::aligned_alloc(kLine, bytes)));
    if (!buffer) throw std::bad_alloc();
    capacity = elements;
  }
  return buffer.get();
}

// The first `count` elements from src (at most a vector's worth) as a vector of acc_t; lanes
// past count are 0. A full vector of bf16/fp16 converts straight from memory: through the
// masked load instead, GCC stored the callers' accumulators to the stack on every iteration.
template <typename acc_t, typename scalar_t>
inline at::vec::Vectorized<acc_t> load_as(const scalar_t* src, int64_t count) {
  using Vec = at::vec::Vectorized<acc_t>;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return Vec::loadu(src, count);
  } else {
    if (count == Vec::size()) {
      Vec full;
      at::vec::load_to_float(src, full);
      return full;
    }
    return std::get<0>(
        at::vec::convert_to_float<scalar_t>(at::vec::Vectorized<scalar_t>::loadu(src, count)));
  }
}

// dst[r * ld + c] = src[r * src_stride + c] * factor for r < rows, c < cols, converted to
// acc_t. Query tiles load with factor = softmax scale, so scores come out of the GEMM scaled.
template <typename scalar_t, typename acc_t>
void load_rows(const scalar_t* src, int64_t src_stride, int64_t rows, int64_t cols, acc_t* dst,
               int64_t ld, acc_t factor = acc_t(1)) {
  using Vec = at::vec::Vectorized<acc_t>;
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* in = src + r * src_stride;
    acc_t* out = dst + r * ld;
    for (int64_t c = 0; c < cols; c += Vec::size()) {
      const int64_t count = std::min<int64_t>(Vec::size(), cols - c);
      (load_as<acc_t>(in + c, count) * Vec(factor)).store(out + c, count);
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
  using Vec = at::vec::Vectorized<acc_t>;
  at::vec::map([factor](Vec x) { return x * Vec(factor); }, dst, src, cols);
}

constexpr double kLog2e = 1.44269504088896340736;
constexpr double kLn2 = 0.69314718055994530942;

// The softmax's exps are powers of 2: the kernels fold log2(e) into the score scale and the
// bias (a running max kept in log2 units, or a logsumexp times log2(e)), so that the exp's
// multiply by log2(e) and the second step of its range reduction go. y = n + f with
// n = round(y), exactly, and 2^f = 1 + f Q(f) with Q of degree 4 (a relative-error fit on
// |f| <= 1/2), coefficients highest degree first. Evaluated in fp32 the result is off by at
// most 1.7e-7 (relative) over [-125, 12] (every fp32 y there, against long double exp2).
constexpr float kExp2Polynomial[] = {1.326456899e-03f, 9.671487845e-03f, 5.550733954e-02f,
                                     2.402224392e-01f, 6.931470037e-01f, 1.f};

#if defined(CPU_CAPABILITY_AVX512)
// 2^y for the softmax, 2^n applied by VSCALEFPS. Below -125 (results under 1.7e-38: hidden
// keys, -inf) the result is a plain 0 from the zero-masked VSCALEFPS: letting the
// instruction underflow into subnormals instead cost a microcode assist per lane, which
// made causal attention at S = 128 2.3x slower than non-causal. The mask also covers what
// the lanes below -125 compute (NaN for -inf), so y needs no clamping first (a clamp cost 5%
// of the softmax). NaN passes.
inline __m512 softmax_exp2(__m512 y) {
  const __mmask16 in_range =
      _mm512_cmp_ps_mask(y, _mm512_set1_ps(-125.f), _CMP_NLT_UQ);  // y >= -125 or NaN
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 poly = _mm512_set1_ps(kExp2Polynomial[0]);
  for (int k = 1; k < 6; ++k) poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(kExp2Polynomial[k]));
  return _mm512_maskz_scalef_ps(in_range, poly, n);
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// softmax_exp2's AVX2 form, in place over kCount vectors. AVX2 has neither VRNDSCALEPS's
// rounding to an integer in a float nor VSCALEFPS, so one add does both: y + (1.5 * 2^23 +
// 127) lands where floats are spaced 1 apart, so the sum is rounded to an integer and its
// low mantissa bits hold n + 127, which shifted into the exponent field make 2^n (exact for
// -125 <= y < 127.5; the softmax's y stay below 12, the backward's near 0). Lanes below -125
// are zeroed, as in the AVX-512 form; NaN passes (NaN times whatever the shift made of its
// bits). 12 instructions where the natural exp took 15 (a multiply by log2(e), a two-step
// reduction by ln 2, and VCVTPS2DQ / VCVTDQ2PS, two cycles each on Zen 1, to round): the
// exp-and-sum pass ran 1.08x faster there. Each step runs over all kCount vectors before
// the next: an exp is a chain of dependent instructions, and with one vector at a time Zen 1
// (256-bit ops split in two) kept about one chain in flight.
template <int kCount>
C10_ALWAYS_INLINE void softmax_exp2s_avx2(__m256 (&y)[kCount]) {
  const __m256 kRound = _mm256_set1_ps(12583039.f);  // 1.5 * 2^23 + 127
  __m256 in_range[kCount], f[kCount], power[kCount], poly[kCount];
  for (int j = 0; j < kCount; ++j)
    in_range[j] = _mm256_cmp_ps(y[j], _mm256_set1_ps(-125.f), _CMP_NLT_UQ);  // or NaN
  for (int j = 0; j < kCount; ++j) {
    const __m256 rounded = _mm256_add_ps(y[j], kRound);
    power[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(rounded), 23));  // 2^n
    f[j] = _mm256_sub_ps(y[j], _mm256_sub_ps(rounded, kRound));
  }
  for (int j = 0; j < kCount; ++j) poly[j] = _mm256_set1_ps(kExp2Polynomial[0]);
  for (int k = 1; k < 6; ++k) {
    for (int j = 0; j < kCount; ++j)
      poly[j] = _mm256_fmadd_ps(poly[j], f[j], _mm256_set1_ps(kExp2Polynomial[k]));
  }
  for (int j = 0; j < kCount; ++j)
    y[j] = _mm256_and_ps(_mm256_mul_ps(poly[j], power[j]), in_range[j]);
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// A vector of bf16 pairs: each 32-bit lane holds two elements, the even one in its low half.
#if defined(CPU_CAPABILITY_AVX512)
using Bf16Pairs = __m512i;
C10_ALWAYS_INLINE Bf16Pairs load_bf16_pairs(const c10::BFloat16* src) {
  return _mm512_loadu_si512(src);
}
#else
using Bf16Pairs = __m256i;
C10_ALWAYS_INLINE Bf16Pairs load_bf16_pairs(const c10::BFloat16* src) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
}
#endif

// The pairs' even elements and their odd ones as fp32 vectors: a bf16 is the high half of the
// fp32 of the same value, so shifting each lane left by 16 gives its low element and clearing
// its low half its high one. One load and two bit operations widen two vectors' elements,
// where widening them in order takes a shuffle and a shift per vector.
C10_ALWAYS_INLINE at::vec::Vectorized<float> even_bf16_elements(Bf16Pairs pairs) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
#else
  return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
#endif
}
C10_ALWAYS_INLINE at::vec::Vectorized<float> odd_bf16_elements(Bf16Pairs pairs) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_castsi512_ps(
      _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#else
  return _mm256_castsi256_ps(
      _mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
#endif
}

// 2^n for integer-valued n (|n| <= 126): VSCALEFPS, or n + 127 shifted into the exponent field.
inline at::vec::Vectorized<float> exp2_of_integer(const at::vec::Vectorized<float>& n) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_scalef_ps(_mm512_set1_ps(1.f), n);
#else
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));
#endif
}

// tanh(y) for y >= 0 (NaN passes) as m / (m + 2) with m = e^(2y) - 1 = 2^z - 1, z = 2y log2(e)
// = n + f: m = 2^n (2^f - 1) + (2^n - 1), and 2^f - 1 = f Q(f) from the softmax's polynomial
// (kExp2Polynomial), so nothing cancels near 0 and the result is within a few ulp. z is
// capped at 64, where tanh is 1 in fp32. at::vec's tanh (SLEEF) made the softcap cost 1.4x
// the whole fp32 forward; this one costs about what the softmax's exp does.
inline at::vec::Vectorized<float> tanh_of_nonnegative(const at::vec::Vectorized<float>& y) {
  using Vec = at::vec::Vectorized<float>;
  const Vec z = at::vec::minimum(Vec(64.f), y * Vec(static_cast<float>(2.0 * kLog2e)));
  const Vec n = z.round();
  const Vec f = z - n;
  Vec poly(kExp2Polynomial[0]);
  for (int k = 1; k < 5; ++k) poly = at::vec::fmadd(poly, f, Vec(kExp2Polynomial[k]));
  const Vec power = exp2_of_integer(n);
  const Vec m = at::vec::fmadd(power, f * poly, power - Vec(1.f));
  return m / (m + Vec(2.f));
}
#endif

// s = cap * tanh(s / cap) over a row in place; derivative, where given, gets
// d capped / d s = 1 - tanh^2 for each column.
template <typename acc_t>
void softcap_row(acc_t* s, int64_t cols, acc_t cap, acc_t* derivative) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec inverse_cap(acc_t(1) / cap);
  for (int64_t c = 0; c < cols; c += Vec::size()) {
    const int count = static_cast<int>(std::min<int64_t>(Vec::size(), cols - c));
    const Vec y = Vec::loadu(s + c, count) * inverse_cap;
    Vec t;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<acc_t, float>) {
      t = tanh_of_nonnegative(y.abs());
      t = Vec::blendv(t, Vec(0.f) - t, y < Vec(0.f));
    } else {
      t = y.tanh();
    }
#else
    t = y.tanh();
#endif
    (t * Vec(cap)).store(s + c, count);
    if (derivative != nullptr) (Vec(acc_t(1)) - t * t).store(derivative + c, count);
  }
}

// s[c] -= slope * |first_distance - c| over a row: the ALiBi bias of keys whose distance to the
// query's diagonal counts down from first_distance.
template <typename acc_t>
void alibi_row(acc_t* s, int64_t cols, acc_t slope, acc_t first_distance) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec step(static_cast<acc_t>(Vec::size()));
  Vec distance = Vec(first_distance) - Vec::arange(acc_t(0), acc_t(1));
  for (int64_t c = 0; c < cols; c += Vec::size(), distance = distance - step) {
    const int count = static_cast<int>(std::min<int64_t>(Vec::size(), cols - c));
    at::vec::fnmadd(Vec(slope), distance.abs(), Vec::loadu(s + c, count)).store(s + c, count);
  }
}

// Horizontal max and sum of one vector: the AVX2 / AVX-512 fp32 vectors' own shuffle
// reductions, at::vec's generic one elsewhere (the generic reduce_add member does not compile).
template <typename acc_t>
acc_t horizontal_max(const at::vec::Vectorized<acc_t>& v) {
  using Vec = at::vec::Vectorized<acc_t>;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) return v.reduce_max();
#endif
  return at::vec::vec_reduce_all<acc_t>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
}
template <typename acc_t>
acc_t horizontal_sum(const at::vec::Vectorized<acc_t>& v) {
  using Vec = at::vec::Vectorized<acc_t>;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) return v.reduce_add();
#endif
  return at::vec::vec_reduce_all<acc_t>([](Vec& a, Vec& b) { return a + b; }, v);
}

// body(std::integral_constant<int, i>{}) for i = 0 .. kCount - 1, written out. Arrays of
// vectors indexed by a loop counter stay in memory under GCC, whose scalar replacement runs
// before it unrolls loops: a register accumulator array indexed so was zeroed and stored on
// the stack for every dot product. Constant indices let it keep them in registers.
template <int kCount, typename Body>
C10_ALWAYS_INLINE void unrolled(Body&& body) {
  [&]<int... kIndex>(std::integer_sequence<int, kIndex...>) C10_ALWAYS_INLINE_ATTRIBUTE {
    (body(std::integral_constant<int, kIndex>{}), ...);
  }(std::make_integer_sequence<int, kCount>{});
}

// Makes the compiler hold v in a register from here on: it folds a load used by several
// FMAs into each of them as a memory operand, loading it once per use.
template <typename acc_t>
C10_ALWAYS_INLINE void keep_in_register(at::vec::Vectorized<acc_t>& v) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    __m256 raw = v;
    asm("" : "+x"(raw));
    v = raw;
  }
#elif defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    __m512 raw = v;
    asm("" : "+v"(raw));
    v = raw;
  }
#endif
}

// sums[i] = horizontal sum of v[i] for i < kCount. In fp32 up to 8 vectors reduce together
// through a tree of shuffles, 2 per sum on AVX-512 where a vector's own reduction takes 4
// (about 2.5 against 6 on AVX2): the shuffle port bounded decode's scores, a handful of dot
// products per cached key. Always inlined: called out of line, the vectors went through the
// stack.
template <int kCount, typename acc_t>
C10_ALWAYS_INLINE void horizontal_sums(const at::vec::Vectorized<acc_t> (&v)[kCount],
                                       acc_t (&sums)[kCount]) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float> && kCount > 1 && kCount <= 8) {
    // in(i): v[i], zero past kCount. Indices are compile-time constants throughout (see
    // unrolled), or the vectors go through the stack.
    auto in = [&v](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
      if constexpr (i < kCount) return __m512(v[i]);
      return _mm512_setzero_ps();
    };
    // halves[j]: 8 partial sums of in[2j] in the low 256 bits, of in[2j + 1] in the high.
    __m512 halves[4];
    unrolled<4>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
      constexpr std::integral_constant<int, 2 * j> even;
      constexpr std::integral_constant<int, 2 * j + 1> odd;
      halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(in(even), in(odd), 0x44),   // quarters 0, 1
                                _mm512_shuffle_f32x4(in(even), in(odd), 0xEE));  // quarters 2, 3
    });
    // quarters[j]: 4 partial sums of in[4j + k] in 128-bit lane k.
    __m512 quarters[2];
    unrolled<2>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
      quarters[j] = _mm512_add_ps(
          _mm512_shuffle_f32x4(halves[2 * j], halves[2 * j + 1], 0x88),   // even quarters
          _mm512_shuffle_f32x4(halves[2 * j], halves[2 * j + 1], 0xDD));  // odd quarters
    });
    // Lane k of 128: 2 partial sums of in[k], then 2 of in[k + 4]; then whole sums in lanes
    // 4k (in[k]) and 4k + 2 (in[k + 4]), gathered into lanes 0..7. A whole 256-bit store:
    // masked stores of a few lanes stalled the loads that read them back.
    const __m512 pairs =
        _mm512_add_ps(_mm512_shuffle_ps(quarters[0], quarters[1], _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm512_shuffle_ps(quarters[0], quarters[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 totals = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    alignas(32) float all[8];
    _mm256_store_ps(all, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, totals)));
    for (int i = 0; i < kCount; ++i) sums[i] = all[i];
    return;
  }
#endif
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float> && kCount > 1 && kCount <= 8) {
    // in(i): v[i], zero past kCount (compile-time indices, as above).
    auto in = [&v](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
      if constexpr (i < kCount) return __m256(v[i]);
      return _mm256_setzero_ps();
    };
    // pairs[j]: in each 128-bit half, lanes (0, 1, 2, 3) hold partial sums of
    // (in[2j], in[2j + 1], in[2j], in[2j + 1]).
    __m256 pairs[4];
    unrolled<4>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
      constexpr std::integral_constant<int, 2 * j> even;
      constexpr std::integral_constant<int, 2 * j + 1> odd;
      pairs[j] = _mm256_add_ps(_mm256_unpacklo_ps(in(even), in(odd)),
                               _mm256_unpackhi_ps(in(even), in(odd)));
    });
    // quads[j]: in each half, lane k holds a partial sum of in[4j + k].
    __m256 quads[2];
    unrolled<2>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
      quads[j] =
          _mm256_add_ps(_mm256_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                        _mm256_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    });
    // Lane i: the whole sum of in[i] (the two halves added).
    const __m256 totals = _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                                        _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
    alignas(32) float all[8];
    _mm256_store_ps(all, totals);
    for (int i = 0; i < kCount; ++i) sums[i] = all[i];
    return;
  }
#endif
  unrolled<kCount>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE { sums[i] = horizontal_sum(v[i]); });
}

#if defined(CPU_CAPABILITY_AVX512)
// The horizontal sums of 16 vectors as one vector, in the order of a 4 x 4 transpose:
// element 4k + e (128-bit lane k, element e) is the sum of v[4e + k]. Four levels of
// shuffles and adds, each halving the vectors: 45 instructions for 16 sums, where
// horizontal_sums takes about 30 for 8 and leaves them to be stored one at a time. `add`
// adds two vectors' lanes: as fp32, or as int32 over the same bits (the shuffles only move
// them), for sums of integers that convert once, after the reduction.
template <typename Add>
C10_ALWAYS_INLINE __m512 transposed_sums16(const __m512 (&v)[16], Add add) {
  // halves[j]: 8 partial sums of v[2j] in the low 256 bits, of v[2j + 1] in the high.
  __m512 halves[8];
  unrolled<8>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
    const __m512 even = v[2 * j], odd = v[2 * j + 1];
    halves[j] = add(_mm512_shuffle_f32x4(even, odd, 0x44), _mm512_shuffle_f32x4(even, odd, 0xEE));
  });
  // quarters[j]: 4 partial sums of v[4j + k] in 128-bit lane k.
  __m512 quarters[4];
  unrolled<4>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
    quarters[j] = add(_mm512_shuffle_f32x4(halves[2 * j], halves[2 * j + 1], 0x88),
                      _mm512_shuffle_f32x4(halves[2 * j], halves[2 * j + 1], 0xDD));
  });
  // pairs[j]: in lane k, 2 partial sums of v[8j + k], then 2 of v[8j + 4 + k].
  __m512 pairs[2];
  unrolled<2>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
    const __m512 a = quarters[2 * j], b = quarters[2 * j + 1];
    pairs[j] = add(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                   _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  });
  // Lane k: the sums of v[k], v[4 + k], v[8 + k], v[12 + k].
  return add(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
             _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

C10_ALWAYS_INLINE __m512 transposed_sums16(const at::vec::Vectorized<float> (&v)[16]) {
  __m512 lanes[16];
  unrolled<16>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE { lanes[i] = v[i]; });
  return transposed_sums16(lanes, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

// transposed_sums16 of int32 vectors (sums that do not overflow), converted to fp32.
C10_ALWAYS_INLINE __m512 transposed_sums16(const __m512i (&v)[16]) {
  __m512 bits[16];
  unrolled<16>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE { bits[i] = _mm512_castsi512_ps(v[i]); });
  const __m512 sums = transposed_sums16(bits, [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  });
  return _mm512_cvtepi32_ps(_mm512_castps_si512(sums));
}
#endif

// 2^y for each vector of y: softmax_exp2 / softmax_exp2s_avx2 in fp32 on AVX-512 / AVX2,
// at::vec's exp2 otherwise (fp64, and the portable build).
template <int kCount, typename acc_t>
C10_ALWAYS_INLINE void softmax_exp2s(at::vec::Vectorized<acc_t> (&y)[kCount]) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    for (int j = 0; j < kCount; ++j) y[j] = softmax_exp2(y[j]);
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    __m256 v[kCount];
    for (int j = 0; j < kCount; ++j) v[j] = y[j];
    softmax_exp2s_avx2(v);
    for (int j = 0; j < kCount; ++j) y[j] = v[j];
    return;
  }
#endif
  for (int j = 0; j < kCount; ++j) y[j] = y[j].exp2();
}

// p[c] = 2^(scale_log2 * s[c] + bias_log2) in place for c < cols, returning the sum of the
// p (added vector by vector in column order, then across lanes). Four vectors at a time go
// through the exp (softmax_exp2s).
template <typename acc_t>
acc_t exp2_row(acc_t* s, int64_t cols, acc_t scale_log2, acc_t bias_log2) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int kStep = 4;
  const Vec scale_vec(scale_log2), bias_vec(bias_log2);
  Vec sum_vec(acc_t(0));
  int64_t c = 0;
  for (; c + kStep * Vec::size() <= cols; c += kStep * Vec::size()) {
    Vec p[kStep];
    for (int j = 0; j < kStep; ++j)
      p[j] = at::vec::fmadd(Vec::loadu(s + c + j * Vec::size()), scale_vec, bias_vec);
    softmax_exp2s(p);
    for (int j = 0; j < kStep; ++j) {
      p[j].store(s + c + j * Vec::size());
      sum_vec = sum_vec + p[j];
    }
  }
  for (; c < cols; c += Vec::size()) {
    const int count = static_cast<int>(std::min<int64_t>(Vec::size(), cols - c));
    Vec p[1] = {at::vec::fmadd(Vec::loadu(s + c, count), scale_vec, bias_vec)};
    softmax_exp2s(p);
    p[0].store(s + c, count);
    sum_vec = sum_vec + Vec::set(Vec(acc_t(0)), p[0], count);  // lanes past the row add nothing
  }
  return horizontal_sum(sum_vec);
}

// How far (in natural units) a tile's scores may exceed a row's running max before the
// online softmax moves the max and rescales; the same in the log2 units of the kernels' maxima.
constexpr int kRescaleMargin = 8;
constexpr double kRescaleMarginLog2 = kRescaleMargin * kLog2e;

// Whether some lane of v is above bound (not a NaN lane).
template <typename acc_t>
bool any_lane_above(const at::vec::Vectorized<acc_t>& v, acc_t bound) {
  using Vec = at::vec::Vectorized<acc_t>;
  // zero_mask() has a bit for each lane that is 0; the comparison's true lanes are all ones.
  return (v > Vec(bound)).zero_mask() != (1 << Vec::size()) - 1;
}

// One key tile's step of the online softmax of `rows` rows, in log2 units: on entry s_tile
// [rows, ld_s] holds the tile's scores (-inf where hidden); on exit it holds
// p = 2^(score_scale log2(e) s - row_max_log2) = exp(score_scale s - row_max_log2 ln 2), and
// the row's logsumexp is row_max_log2 ln 2 + log(row_sum). The running max moves lazily:
// only when a tile's max exceeds it by more than kRescaleMargin (natural units) does it
// jump to that max, with the sum and the row's output accumulator (o_tile [rows, ld_o])
// rescaled. Most tiles thus skip the rescale, and p stays below e^8 (about 3000), harmless
// in fp32 sums. While a row has seen no key, its tile gets p = 0 and nothing changes.
// score_scale (> 0) multiplies the scores first, fused into the exp with log2(e): a kernel
// whose GEMM left them unscaled saves a pass over the tile.
// The max pass runs over all rows before the exp pass, so that the core overlaps the rows'
// reductions, and asks only whether some lane passes the margin: the horizontal max waits
// for a row that moves its max (on Zen 1 the pass took 0.08 instead of 0.13 ns per score).
template <typename acc_t>
void online_softmax_tile(acc_t* s_tile, int64_t ld_s, int64_t rows, int64_t cols,
                         acc_t* row_max_log2, acc_t* row_sum, acc_t* o_tile, int64_t ld_o,
                         int64_t head_dim_v, acc_t score_scale = acc_t(1)) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t kWidth = Vec::size();
  constexpr acc_t kMinusInf = -std::numeric_limits<acc_t>::infinity();
  const acc_t scale_log2 = static_cast<acc_t>(score_scale * kLog2e);
  const acc_t margin_log2 = static_cast<acc_t>(kRescaleMarginLog2);
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t* s = s_tile + r * ld_s;
    Vec highest_even(kMinusInf), highest_odd(kMinusInf);  // two chains of maxima, overlapped
    int64_t c = 0;
    for (; c + 2 * kWidth <= cols; c += 2 * kWidth) {
      highest_even = at::vec::clamp_min(Vec::loadu(s + c), highest_even);
      highest_odd = at::vec::clamp_min(Vec::loadu(s + c + kWidth), highest_odd);
    }
    for (; c < cols; c += kWidth) {
      const int count = static_cast<int>(std::min<int64_t>(kWidth, cols - c));
      highest_even =
          at::vec::clamp_min(Vec::set(highest_even, Vec::loadu(s + c, count), count), highest_even);
    }
    const Vec highest = at::vec::clamp_min(highest_even, highest_odd) * Vec(scale_log2);
    if (any_lane_above(highest,
                       row_max_log2[r] + margin_log2)) {  // also the first tile with a visible key
      const acc_t tile_max = horizontal_max(highest);
      if (row_sum[r] != acc_t(0)) {
        const acc_t rescale = std::exp2(row_max_log2[r] - tile_max);
        row_sum[r] *= rescale;
        acc_t* o_row = o_tile + r * ld_o;
        at::vec::map([rescale](Vec x) { return x * Vec(rescale); }, o_row, o_row, head_dim_v);
      }
      row_max_log2[r] = tile_max;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    acc_t* s = s_tile + r * ld_s;
    if (row_max_log2[r] == kMinusInf) {  // no visible key yet: p = 0 (a NaN score stays NaN)
      std::replace(s, s + cols, kMinusInf, acc_t(0));
      continue;
    }
    row_sum[r] += exp2_row(s, cols, scale_log2, -row_max_log2[r]);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// Whether the AVX-512 build may run its AVX512-BF16 paths: only at the avx512_bf16 and
// avx512_amx levels of cpu/isa.h, which the CPU must support and MHA_EXT_CPU_ISA=avx512 or
// avx512_vnni turns off, so that the build's other paths run (and are tested) on these CPUs
// too.
inline bool avx512_bf16_enabled() { return active_cpu_isa() >= CpuIsa::kAvx512Bf16; }

// Whether it may run its AVX512-VNNI path (paged decode's int16 dot products): from the
// avx512_vnni level on.
inline bool avx512_vnni_enabled() { return active_cpu_isa() >= CpuIsa::kAvx512Vnni; }

// dst = src rounded to bf16 (nearest even), 32 at a time with VCVTNE2PS2BF16.
__attribute__((target("avx512bf16"))) inline void round_to_bf16(const float* src,
                                                                c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512bh pairs =
        _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, reinterpret_cast<__m512i>(pairs));
  }
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

// The lanes of a 16-float vector that hold the first `count` values (none up to 0, all 16
// from 16 on).
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1);
}

// Partial sums per row of the bf16 forward's softmax, one per lane of a vector: a tile's
// exps add to them lane by lane, and the one horizontal sum per row waits for the end.
constexpr int64_t kSumLanes = 16;

// score_scale * (the max of s[0, cols)), -inf when every score is.
inline float scaled_row_max(const float* s, int64_t cols, float score_scale) {
  __m512 highest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 lanes = first_lanes(cols - c);
    highest = _mm512_mask_max_ps(highest, lanes, highest, _mm512_maskz_loadu_ps(lanes, s + c));
  }
  return score_scale * _mm512_reduce_max_ps(highest);
}

// p[c] = 2^(scale_log2 s[c] - max_log2) = exp(score_scale s[c] - max) for c < cols and 0 for
// c up to the next multiple of 32, as bf16 or fp32 (out_t), with the sum added lane by lane
// to sums[16]. When `check` is set and some exponent exceeds kRescaleMargin (in natural
// units), sums is left alone and false returned: the row needs a new max and the step
// redone. scale_log2 = score_scale log2(e) rounded to fp32 changes the softmax scale in the
// 8th digit, the size of the scores' own fp32 rounding.
template <typename out_t>
__attribute__((target("avx512bf16"), always_inline)) inline bool probs_row(
    const float* s, int64_t cols, float scale_log2, float max_log2, bool check, float* sums,
    out_t* p) {
  const __m512 scale = _mm512_set1_ps(scale_log2), minus_max = _mm512_set1_ps(-max_log2);
  __m512 total = _mm512_setzero_ps();
  __m512 highest =
      _mm512_set1_ps(-std::numeric_limits<float>::infinity());  // of the exps' arguments (log2)
  for (int64_t c = 0; c < cols; c += 32) {
    // Lanes past cols load as 0 and have their exp zeroed; whole pairs of vectors (the
    // common case) take no masks.
    const bool whole = c + 32 <= cols;
    const __mmask16 low_lanes = first_lanes(cols - c), high_lanes = first_lanes(cols - c - 16);
    __m512 x[2], probs[2];
    for (int j = 0; j < 2; ++j) {
      const __mmask16 lanes = j == 0 ? low_lanes : high_lanes;
      const __m512 scores =
          whole ? _mm512_loadu_ps(s + c + 16 * j) : _mm512_maskz_loadu_ps(lanes, s + c + 16 * j);
      x[j] = _mm512_fmadd_ps(scores, scale, minus_max);
      probs[j] = softmax_exp2(x[j]);
      if (!whole) {
        x[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), lanes,
                                  x[j]);
        probs[j] = _mm512_maskz_mov_ps(lanes, probs[j]);
      }
    }
    highest = _mm512_max_ps(highest, _mm512_max_ps(x[0], x[1]));
    total = _mm512_add_ps(total, _mm512_add_ps(probs[0], probs[1]));
    if constexpr (std::is_same_v<out_t, float>) {
      _mm512_storeu_ps(p + c, probs[0]);
      _mm512_storeu_ps(p + c + 16, probs[1]);
    } else {
      _mm512_storeu_si512(p + c,
                          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(probs[1], probs[0])));
    }
  }
  const __m512 margin = _mm512_set1_ps(static_cast<float>(kRescaleMarginLog2));
  if (check && _mm512_cmp_ps_mask(highest, margin, _CMP_GT_OQ) != 0) return false;
  _mm512_storeu_ps(sums, _mm512_add_ps(_mm512_loadu_ps(sums), total));
  return true;
}

// The bf16 forward's online-softmax step over a key tile: the same lazy rescale as
// online_softmax_tile, but one pass per row where that takes two, and the running max in
// log2 units (row_max_log2: the max of score_scale log2(e) s, the exponent's own terms, so
// that the sums are exact sums of 2^(that - max) and the logsumexp is max ln 2 + log(sum)).
// The exps run against the running max as it stands, and only a row in which some score
// exceeds it by more than the margin (rare past a row's first tiles) takes a max pass and a
// second exp pass. P goes to
// p_tile [rows, ld_p] (bf16, or fp32 for a caller that still applies dropout; zeros past
// cols up to a multiple of 32, so ld_p >= cols rounded up to 32) instead of over the
// scores, which the second pass reads, and the sums stay per lane (row_sums [rows,
// kSumLanes]). With softmax_exp2, 1.4x faster than online_softmax_tile and a separate
// rounding of P (softmax_bench: 0.22 -> 0.15 ns per score at 128 keys, 0.24 -> 0.17 at 64):
// the max pass's loads and horizontal max, the per-row horizontal sum, the rounding pass's
// reloads and two of the exp's instructions go.
template <typename out_t>
__attribute__((target("avx512bf16"))) void softmax_tile_to_probs(
    const float* s_tile, int64_t ld_s, int64_t rows, int64_t cols, float score_scale,
    float* row_max_log2, float* row_sums, float* o_tile, int64_t ld_o, int64_t head_dim_v,
    out_t* p_tile, int64_t ld_p) {
  using Vec = at::vec::Vectorized<float>;
  const float scale_log2 = static_cast<float>(score_scale * kLog2e);
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = s_tile + r * ld_s;
    float* sums = row_sums + r * kSumLanes;
    out_t* p = p_tile + r * ld_p;
    float& max_log2 = row_max_log2[r];
    // A row that has seen no key yet starts from this tile's max; with none here either its
    // P is 0 (through the exp's mask: every argument is -inf).
    if (max_log2 == -std::numeric_limits<float>::infinity())
      max_log2 = scaled_row_max(s, cols, scale_log2);
    if (max_log2 == -std::numeric_limits<float>::infinity()) {
      std::fill(p, p + round_up(cols, 32), out_t(0.f));
      continue;
    }
    if (probs_row(s, cols, scale_log2, max_log2, /*check=*/true, sums, p)) continue;
    const float tile_max = scaled_row_max(s, cols, scale_log2);
    const float rescale = std::exp2(max_log2 - tile_max);
    _mm512_storeu_ps(sums, _mm512_mul_ps(_mm512_loadu_ps(sums), _mm512_set1_ps(rescale)));
    float* o_row = o_tile + r * ld_o;
    at::vec::map([rescale](Vec x) { return x * Vec(rescale); }, o_row, o_row, head_dim_v);
    max_log2 = tile_max;
    probs_row(s, cols, scale_log2, tile_max, /*check=*/false, sums, p);
  }
}
#endif

// Writes a finished row: out = o / sum, and returns its logsumexp, max + log(sum) added in
// double (the max may come in log2 units times ln 2; the log of the sum is the fp32 one:
// the double one took 0.7% of the bf16 GQA forward). A row that saw no key has sum 0:
// output 0 and logsumexp -inf, never NaN. An attention sink (a logit with no value, -inf
// for none) joins the sum as exp(sink - max), in double: far from the scores it leaves fp32's
// range; a row that saw no key then has the sink's logsumexp.
template <typename scalar_t, typename acc_t>
acc_t finish_row(const acc_t* o_row, int64_t head_dim_v, double row_max, acc_t row_sum,
                 scalar_t* out_row, double sink = -std::numeric_limits<double>::infinity()) {
  const bool empty = row_sum == acc_t(0);
  if (empty || sink == -std::numeric_limits<double>::infinity()) {
    store_row(o_row, head_dim_v, empty ? acc_t(0) : acc_t(1) / row_sum, out_row);
    return empty ? static_cast<acc_t>(sink)
                 : static_cast<acc_t>(row_max + static_cast<double>(std::log(row_sum)));
  }
  const double sum = static_cast<double>(row_sum) + std::exp(sink - row_max);
  store_row(o_row, head_dim_v, static_cast<acc_t>(1.0 / sum), out_row);
  return static_cast<acc_t>(row_max + std::log(sum));
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
