#pragma once
// Attention that reads keys and values from a paged cache through block tables, for a batch
// of sequences of different lengths: decode (one query per sequence) and chunked prefill
// (several), causal with the queries as the last tokens of each sequence.
//
// One task per (sequence, kv heads, chunk of queries, split of the keys): decode takes a
// sequence's kv heads together, head by head within each key tile (plan_paged_tasks). The
// query heads of a GQA group are packed as rows of one query tile, so each K/V element is
// read once per group: for decode, the tile rows are the group's heads. Key tiles of 64
// tokens are gathered from whatever blocks hold them, so any block size works. With few
// tasks for the threads, long contexts are split and the partial results merged by
// logsumexp.
//
// Included by one translation unit per CPU ISA (kernels_<isa>.cpp).
#include <ATen/Parallel.h>

#include <type_traits>
#include <utility>

#include "blocking.h"
#include "kernel_common.h"
#include "mha_ext/paged_cache.h"
#include "mha_ext/paged_params.h"
#include "tile_gemm.h"

namespace mha_ext::cpu {
inline namespace CPU_CAPABILITY {

// The cache rows of positions [first, first + count) of a sequence, for one kv head: rows[i]
// holds position first + i. The block table is looked up once per block, not per row: the
// 64-bit divisions that locate a position (block_size is known only at run time), four per
// key row with the prefetch, were a large part of decode's time per key.
template <typename scalar_t>
void cache_rows(const scalar_t* cache, const CacheStrides& strides, const int32_t* block_table,
                int64_t block_size, int64_t kv_head, int64_t first, int64_t count, const scalar_t** rows) {
  for (int64_t i = 0; i < count;) {
    const CacheSlot slot = slot_location(slot_of_position(block_table, first + i, block_size), block_size);
    const scalar_t* row = cache + slot.block * strides.block + kv_head * strides.head + slot.offset * strides.offset;
    const int64_t in_block = std::min(block_size - slot.offset, count - i);
    for (int64_t j = 0; j < in_block; ++j, ++i) rows[i] = row + j * strides.offset;
  }
}

// Cached rows are requested this many positions before they are read. A sequence's blocks
// lie anywhere in the cache and hold a few KiB per head, and the hardware prefetchers stop
// at every page boundary: without the requests, decode read a bf16 cache at 40% of the
// streaming bandwidth, most of the time spent waiting on loads that missed. Further ahead
// is worse: the next tile's 64 K and V rows requested during this tile's value pass (a line
// of each per slice step, none in the score loop) decoded fp32 32q/8kv at 9.5 GB/s against
// 14.5 on Zen 1. There the hint (t0, t1, nta) made no difference, so the requests likely
// all fill L1, which a tile's rows (64 KiB of fp32 at head dim 128) overflow.
constexpr int64_t kPrefetchRows = 16;

// Requests the 64-byte line holding *address into the caches.
C10_ALWAYS_INLINE void request_line(const void* address) {
#if defined(__x86_64__)
  // GCC 12 drops __builtin_prefetch from the row loops once inlined (no PREFETCH was left in
  // the kernels), so the instruction is written out.
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(address)));
#else
  __builtin_prefetch(address, 0, 2);
#endif
}

// Requests bytes [first_byte, end_byte) of a row, one 64-byte line at a time.
C10_ALWAYS_INLINE void request_bytes(const void* row, int64_t first_byte, int64_t end_byte) {
  const char* bytes = static_cast<const char*>(row);
  for (int64_t byte = first_byte; byte < end_byte; byte += 64) request_line(bytes + byte);
}

// Requests elements [first, dim) of a row.
template <typename scalar_t>
void prefetch_row(const scalar_t* row, int64_t dim, int64_t first = 0) {
  request_bytes(row, first * static_cast<int64_t>(sizeof(scalar_t)), dim * static_cast<int64_t>(sizeof(scalar_t)));
}

// One key tile of one kv head: keys [key0, key0 + cols); cols 0 marks the end of a task. A
// task's items go through its key tiles in order, and within a tile through its heads; "the
// next tile" below is the next item, the same keys of the next head where there is one.
struct WorkItem {
  int64_t key0 = 0;
  int64_t cols = 0;
  int64_t kv_head = 0;
};

// A key tile's cached rows: rows[i] for i < listed, the tile's own rows first and then up to
// kPrefetchRows rows of the next tile, which the tile's loop requests ahead of use.
template <typename scalar_t>
struct TileRows {
  const scalar_t* rows[kKeyBlock + kPrefetchRows];
  int64_t listed = 0;

  void prefetch(int64_t i, int64_t dim) const {
    if (i + kPrefetchRows < listed) prefetch_row(rows[i + kPrefetchRows], dim);
  }

  // The row that prefetch(i) requests; row i itself (already cached) where none is listed.
  const scalar_t* row_ahead(int64_t i) const { return i + kPrefetchRows < listed ? rows[i + kPrefetchRows] : rows[i]; }
};

// Rows [0, count) of a tile copied like load_rows into dst [count, ld].
template <typename scalar_t, typename acc_t>
void gather_tile_rows(const TileRows<scalar_t>& tile, int64_t count, int64_t dim, acc_t* dst, int64_t ld) {
  for (int64_t i = 0; i < count; ++i) {
    tile.prefetch(i, dim);
    load_rows(tile.rows[i], 0, 1, dim, dst + i * ld, ld);
  }
}

// The direct path's value pass weights the tile rows in groups of at most this many, each
// group reading the values again (from L1); the score pass takes all rows at once
// (score_tile). On AVX2 (16 registers) an fp32 cache goes 4 rows at a time, whose
// accumulators for a slice of O fit beside the value vectors. A bf16 cache is not split, as
// each further read of a value converts it again (1.6x slower split), except where that
// conversion is cheap (kWidenInPairs: accumulate_values). AVX-512's 32 registers take all rows.
template <typename scalar_t, typename acc_t>
constexpr int kValueRowGroup =
#if defined(CPU_CAPABILITY_AVX512)
    kDirectRows;
#else
    std::is_same_v<scalar_t, acc_t> ? 4 : kDirectRows;
#endif

// Whether a direct tile of `rows` rows has its value pass request the next tile's key rows,
// spread over the pass's steps, while its score pass requests only its own value rows. The
// other plan requests both in the score pass (a key row kPrefetchRows ahead and the value row
// of the key being scored) and leaves memory idle while the values pass, a third of an fp32
// 4-row tile's time on Zen 1. Measured there (8 sequences, context 4096, fp32, two threads,
// rounds alternating old and new builds; with score_keys' two chains, without which this
// plan gained nothing): through the op, the benchmark's decode case, one head per kv head
// (llama2-7b) median 19.4 against 16.9 GB/s, 32q/8kv 15.5 against 15.3 (within the noise);
// a standalone harness of the kernel gave 17.8 against 16.0 and 16.0-16.5 against 15.3-16.0.
// 8-row tiles (llama2-70b, 10.1 against 10.8) and bf16 caches (8.9 against 9.6) are bound
// by their arithmetic and lost to the value pass's extra work. On AVX-512 (Zen 5) every
// tile of 2 or more rows takes this plan, with kValuesRequestedTileAhead: fp32 32q/8kv from
// memory on one core, medians of 15 rounds alternating the builds of a standalone harness,
// 13.2 -> 14.6 GB/s; through the op on two cores 21.5-27.1 -> 23.2-33.5 GB/s in alternating
// runs (the VM's streaming rate moved between 31 and 48 GB/s meanwhile).
template <typename scalar_t>
constexpr bool value_pass_requests_keys(int64_t rows) {
#if defined(CPU_CAPABILITY_AVX512)
  return rows > 1;
#else
  return sizeof(scalar_t) == 4 && rows <= kValueRowGroup<scalar_t, scalar_t>;
#endif
}

// Whether, where the value pass requests the next tile's keys, the score pass requests the
// next tile's value rows too (the tile's own were requested a tile earlier, the first
// tile's up front) rather than its own: every request then has a whole tile's work before
// its use, and the two passes request alike. With AVX-512's faster score passes (bf16 dot
// products, 16 sums per reduction) requests for a tile's own values came too close to their
// use: bf16 32q/8kv from memory on two cores, harness medians of 11 rounds, 20.6 -> 23.5
// GB/s; fp32 22.7 either way. Not measured on AVX2, which keeps requesting its own.
constexpr bool kValuesRequestedTileAhead =
#if defined(CPU_CAPABILITY_AVX512)
    true;
#else
    false;
#endif

// Rows whose lines a pass requests over `sweeps` sweeps through its keys: each sweep
// requests its share of every row's lines, row c's at key c, so that each key costs the same
// few requests and every line is asked for by the last sweep. The value pass requests the
// next tile's key rows so, a sweep per O slice and row group; the next tile never has more
// keys than this one (only a task's last key tile is short, and what follows it is the same
// tile of the next head). A running position through the lines, a few per key, spent a
// quarter of the value pass on its compares and branches (perf, fp32 32q/8kv decode from L2).
template <typename scalar_t>
struct SweepRequests {
  const scalar_t* const* rows = nullptr;
  int64_t count = 0;
  int64_t dim = 0;

  // Bytes [first, last) of each row, whole lines, that sweep `sweep` of `sweeps` requests.
  std::pair<int64_t, int64_t> share(int64_t sweep, int64_t sweeps) const {
    const int64_t lines = ceil_div(dim * static_cast<int64_t>(sizeof(scalar_t)), int64_t(64));
    return {sweep * lines / sweeps * 64, (sweep + 1) * lines / sweeps * 64};
  }
};

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

// Whether the direct path widens a cache's rows to fp32 16 elements at a time
// (widen_bf16_pairs): bf16 on AVX2. at::vec widens 8 bf16 at a time by zero-extending them
// (VPMOVZXWD, a shuffle, which Zen 1 runs on one of the two pipes its FMAs use) and shifting;
// one 32-byte load and two bit operations give 16, out of order (the even elements, then the
// odd). The tile's q rows and O rows keep each whole group of 16 elements in that order
// (reorder_groups_of_16): a dot product or an elementwise sum takes its terms in any order.
// Measured on Zen 1 (the kernel called directly, 8 sequences x context 4096, a bf16 decode
// being bound by its arithmetic there): on one core 32q/8kv 4.58 -> 5.22 GB/s, 32q/32kv
// 6.48 -> 7.38, 64q/8kv 2.86 -> 2.93 (8 rows, whose accumulators leave no room for a second
// chain); on two, medians of 10 rounds alternating the builds, 6.71 -> 7.36, 10.8 -> 12.9
// and 5.77 -> 6.02.
template <typename scalar_t>
constexpr bool kWidenInPairs =
#if defined(CPU_CAPABILITY_AVX2)
    std::is_same_v<scalar_t, c10::BFloat16>;
#else
    false;
#endif

#if defined(CPU_CAPABILITY_AVX2)
// src[0, 16) as fp32, the even elements in `even` and the odd ones in `odd`: a bf16 is the
// high half of the fp32 of the same value, so shifting each 32-bit lane left by 16 gives its
// low element and clearing the lane's low half its high one.
C10_ALWAYS_INLINE void widen_bf16_pairs(const c10::BFloat16* src, __m256& even, __m256& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif

// Reorders each whole group of 16 elements of row[0, dim) from natural order to the order
// widen_bf16_pairs gives (elements 0, 2, .., 14, then 1, 3, .., 15) or, with to_pairs false,
// back. Elements past the last whole group stay in place. Once per tile row and task.
template <typename acc_t>
void reorder_groups_of_16(acc_t* row, int64_t dim, bool to_pairs) {
  for (int64_t group = 0; group + 16 <= dim; group += 16) {
    acc_t copy[16];
    std::copy(row + group, row + group + 16, copy);
    for (int i = 0; i < 8; ++i) {
      if (to_pairs) {
        row[group + i] = copy[2 * i];
        row[group + 8 + i] = copy[2 * i + 1];
      } else {
        row[group + 2 * i] = copy[i];
        row[group + 2 * i + 1] = copy[8 + i];
      }
    }
  }
}

// src[0, 2 * vector width) as two fp32 vectors, first and second, for a two-vector step: in
// natural order, or in widen_bf16_pairs' order where kWidenInPairs.
template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE void load_two_vectors(const scalar_t* src, at::vec::Vectorized<acc_t>& first,
                                        at::vec::Vectorized<acc_t>& second) {
  constexpr int64_t kWidth = at::vec::Vectorized<acc_t>::size();
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kWidenInPairs<scalar_t>) {
    __m256 even, odd;
    widen_bf16_pairs(src, even, odd);
    first = even;
    second = odd;
    return;
  }
#endif
  first = load_as<acc_t>(src, kWidth);
  second = load_as<acc_t>(src + kWidth, kWidth);
}

// Keys scored together by the direct path: on AVX-512, enough that their kRows x kKeys dot
// products share one reduction tree: 16 for 2, 4 or 8 rows (transposed_sums16, one vector
// of sums; 8 rows from L2 on one core 23.6 -> 26.0 GB/s against 8 sums through
// horizontal_sums, 4 rows unchanged), at most 8 otherwise, and 8 keys for one row (16
// decoded llama2-7b's heads 5-10% slower from memory); elsewhere one, as more
// accumulators and keys would not fit AVX2's 16 registers (and two keys of an fp32 cache at
// a time for 4 rows, which fit, decoded 5-15% faster from L2 but 10-20% slower from memory,
// with the row requests before each step or spread through its loop alike).
template <int kRows>
constexpr int kKeysPerStep =
#if defined(CPU_CAPABILITY_AVX512)
    kRows > 1 && 16 % kRows == 0 ? 16 / kRows : kRows <= 8 ? 8 / kRows : 1;
#else
    1;
#endif

#if defined(CPU_CAPABILITY_AVX512)
// acc + the dot products of a's and b's bf16 pairs, one per fp32 lane (VDPBF16PS: exact
// products, fp32 sums). Written as assembly so that this translation unit, which also runs
// on AVX-512 CPUs without BF16, needs no target attribute; it runs only where
// avx512_bf16_enabled().
C10_ALWAYS_INLINE __m512 add_bf16_pair_dots(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
#endif

// Whether the direct path scores a bf16 cache with AVX512-BF16 dot products of bf16 pairs
// (where the CPU has them), q's rows kept in bf16 and the scale applied to the sums: one
// instruction takes 32 elements of a key for a row, where widening them to fp32 takes two
// conversions per 16 and then two FMAs per row, and the products are as exact (a bf16
// product fits fp32). On Zen 5, one core, cache in L3: 32q/8kv 20.7 -> 32.5 GB/s, 64q/8kv
// 13.2 -> 17.2. The value pass keeps fp32 weights: dot products there would round P to bf16.
template <typename scalar_t>
constexpr bool kScoreByBf16Dots =
#if defined(CPU_CAPABILITY_AVX512)
    std::is_same_v<scalar_t, c10::BFloat16>;
#else
    false;
#endif

// What a one-key score step requests while it walks its key row: nothing, the value row of
// the key being scored, or that and the key row kPrefetchRows ahead (dim elements).
enum class ScoreLoopRequests { kNone, kValue, kKeyAheadAndValue };

template <typename scalar_t>
struct RowRequests {
  const scalar_t* key_ahead;
  const scalar_t* value;
  int64_t value_dim;
};

// Whether score_tile spreads its row requests through the score loop, a line of each row
// per 64 bytes of key, instead of requesting both rows before the step. Measured on AVX2
// (Zen 1): an fp32 key's 16 requests at once decoded 32q/8kv at 12.1 GB/s, spread out at
// 15.0 (llama2-70b heads 10.2 -> 10.6); a bf16 key's 8 requests lost 3% spread out. Not
// measured on AVX-512, whose steps score several keys.
template <typename scalar_t, int kKeys>
constexpr bool kRequestRowsInScoreLoop =
#if defined(CPU_CAPABILITY_AVX512)
    false;
#else
    kKeys == 1 && sizeof(scalar_t) == 4;
#endif

// scores[r * ld_s + j] = scale x the horizontal sum of acc[j * kRows + r] for r < kRows,
// j < kKeys.
// On AVX-512, 16 sums reduce together into one vector (transposed_sums16), permuted so that
// each row's kKeys sums lie together and stored a row at a time.
template <int kRows, int kKeys, typename acc_t>
C10_ALWAYS_INLINE void store_dot_products(const at::vec::Vectorized<acc_t> (&acc)[kKeys * kRows], acc_t scale,
                                          acc_t* scores, int64_t ld_s) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float> && kRows * kKeys == 16) {
    __m512 sums = _mm512_mul_ps(transposed_sums16(acc), _mm512_set1_ps(scale));
    if constexpr (kRows != 4) {  // with 4 rows the transpose leaves row r's 4 sums in lane r
      // Element r * kKeys + j takes the sum of acc[i], i = j * kRows + r, at 4 (i % 4) + i / 4.
      static constexpr auto kOrder = [] {
        std::array<int, 16> order{};
        for (int r = 0; r < kRows; ++r) {
          for (int j = 0; j < kKeys; ++j) order[r * kKeys + j] = 4 * ((j * kRows + r) % 4) + (j * kRows + r) / 4;
        }
        return order;
      }();
      sums = _mm512_permutexvar_ps(_mm512_loadu_si512(kOrder.data()), sums);
    }
    unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
      float* row = scores + r * ld_s;
      if constexpr (kKeys == 16) {
        _mm512_storeu_ps(row, sums);
      } else if constexpr (kKeys == 8) {
        _mm256_storeu_ps(row, _mm512_extractf32x8_ps(sums, r));
      } else if constexpr (kKeys == 4) {
        _mm_storeu_ps(row, _mm512_extractf32x4_ps(sums, r));
      } else {
        static_assert(kKeys == 2, "16 sums as kRows rows of kKeys");
        const __m128 lane = _mm512_extractf32x4_ps(sums, r / 2);
        if constexpr (r % 2 == 0) {
          _mm_storel_pi(reinterpret_cast<__m64*>(row), lane);
        } else {
          _mm_storeh_pi(reinterpret_cast<__m64*>(row), lane);
        }
      }
    });
    return;
  }
#endif
  acc_t sums[kKeys * kRows];
  horizontal_sums(acc, sums);
  for (int j = 0; j < kKeys; ++j) {
    for (int r = 0; r < kRows; ++r) scores[r * ld_s + j] = scale * sums[j * kRows + r];
  }
}

// scores[r * ld_s + j] = q[r] . keys[j] for r < kRows, j < kKeys: each vector of a cached key
// is loaded and converted once for all rows. kRequests: which of `requests`' rows it requests.
template <int kRows, int kKeys, ScoreLoopRequests kRequests, typename q_t, typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE void score_keys(const q_t* q, int64_t ld_q, const scalar_t* const* keys, int64_t dim, acc_t scale,
                                  acc_t* scores, int64_t ld_s, const RowRequests<scalar_t>& requests) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (!std::is_same_v<q_t, acc_t>) {  // bf16 q and keys: kScoreByBf16Dots
    static_assert(kRequests == ScoreLoopRequests::kNone && kScoreByBf16Dots<scalar_t>, "bf16 dot products");
    at::vec::Vectorized<float> acc[kKeys * kRows];  // acc[j * kRows + r]: part of q[r] . keys[j]
    unrolled<kKeys * kRows>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE { acc[i] = _mm512_setzero_ps(); });
    // 32 elements from d on, the lanes outside `lanes` zero (and not read).
    auto step = [&](int64_t d, __mmask32 lanes) C10_ALWAYS_INLINE_ATTRIBUTE {
      __m512i k[kKeys];
      unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE { k[j] = _mm512_maskz_loadu_epi16(lanes, keys[j] + d); });
      unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
        const __m512i q_r = _mm512_maskz_loadu_epi16(lanes, q + r * ld_q + d);
        unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
          acc[j * kRows + r] = add_bf16_pair_dots(acc[j * kRows + r], q_r, k[j]);
        });
      });
    };
    int64_t d = 0;
    for (; d + 32 <= dim; d += 32) step(d, ~__mmask32(0));
    if (d < dim) step(d, static_cast<__mmask32>((uint64_t(1) << (dim - d)) - 1));
    store_dot_products<kRows, kKeys>(acc, scale, scores, ld_s);
    return;
  }
#endif
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t kWidth = Vec::size();
  // Vectors per step: two for one key of an fp32 cache or of a bf16 cache widened in pairs
  // (kWidenInPairs), where q's rows hold each whole group of 16 elements in the pairs' order.
  constexpr int kStepVectors =
      kKeys == 1 && (std::is_same_v<scalar_t, acc_t> || kWidenInPairs<scalar_t>) ? 2 : 1;
  // Accumulator chains per dot product: one key's kRows FMAs per vector are too few to cover
  // the FMA latency, so a step's two vectors go to two chains where their accumulators fit
  // the registers beside the two key vectors and a q vector (not for 7 or 8 rows). On
  // Zen 1 that scores fp32 faster from cache (32q/8kv decode 11.4 against 10.2 GB/s on one
  // core); from memory it pays only where the value pass requests the keys
  // (value_pass_requests_keys), as a shorter score pass that requests them all left more of
  // the tile's time to the value pass without reads (13.0 against 14.3 GB/s). Each vector's
  // loads come before its FMAs, row by row alternating chains: chain by chain, the same plan
  // read 15.2 against 16.5.
  constexpr int kChains = kStepVectors == 2 && 2 * kRows + 3 <= kVectorRegisters ? 2 : 1;
  Vec acc[kChains][kKeys * kRows];  // acc[chain][j * kRows + r]: part of q[r] . keys[j]
  unrolled<kChains * kKeys * kRows>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
    acc[i / (kKeys * kRows)][i % (kKeys * kRows)] = Vec(acc_t(0));
  });
  auto request_lines = [&](int64_t d) C10_ALWAYS_INLINE_ATTRIBUTE {
    if constexpr (kRequests != ScoreLoopRequests::kNone) {
      if (d * static_cast<int64_t>(sizeof(scalar_t)) % 64 == 0) {
        if constexpr (kRequests == ScoreLoopRequests::kKeyAheadAndValue) request_line(requests.key_ahead + d);
        if (d < requests.value_dim) request_line(requests.value + d);
      }
    }
  };
  // `vectors` vectors from d on (kStepVectors, or one in natural order), vector v into chain
  // v % kChains.
  auto step = [&](int64_t d, auto vectors) C10_ALWAYS_INLINE_ATTRIBUTE {
    Vec k[vectors][kKeys];
    if constexpr (vectors == 2) {
      load_two_vectors(keys[0] + d, k[0][0], k[1][0]);  // kStepVectors is 2 for one key only
    } else {
      unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE { k[0][j] = load_as<acc_t>(keys[j] + d, kWidth); });
    }
    unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
      unrolled<vectors>([&](auto v) C10_ALWAYS_INLINE_ATTRIBUTE {
        // One load of q's vector for the kKeys keys: given it as an FMA operand, GCC loads
        // it again for each key, and the loads outnumber the FMAs. With one key, the load
        // folded into the FMA is the same load in fewer instructions: on Zen 1 bf16 decode
        // ran 4-18% faster so (32q/8kv and llama2-70b heads), fp32 within the noise.
        Vec q_r = Vec::loadu(q + r * ld_q + d + v * kWidth);
        if constexpr (kKeys > 1) keep_in_register(q_r);
        constexpr int chain = v % kChains;
        unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
          acc[chain][j * kRows + r] = at::vec::fmadd(q_r, k[v][j], acc[chain][j * kRows + r]);
        });
      });
    });
  };
  // Whole steps; the loops over rows and keys are written out (unrolled) so that acc lives
  // in registers.
  int64_t d = 0;
  for (; d + kStepVectors * kWidth <= dim; d += kStepVectors * kWidth) {
    request_lines(d);
    step(d, std::integral_constant<int, kStepVectors>{});
  }
  if constexpr (kStepVectors > 1) {
    for (; d + kWidth <= dim; d += kWidth) {
      request_lines(d);
      step(d, std::integral_constant<int, 1>{});
    }
  }
  if constexpr (kChains > 1) {
    unrolled<kKeys * kRows>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE { acc[0][i] = acc[0][i] + acc[1][i]; });
  }
  if constexpr (kRequests != ScoreLoopRequests::kNone) {  // the lines the loop did not reach
    const int64_t next = round_up(d * static_cast<int64_t>(sizeof(scalar_t)), int64_t(64)) /
                         static_cast<int64_t>(sizeof(scalar_t));
    if constexpr (kRequests == ScoreLoopRequests::kKeyAheadAndValue) prefetch_row(requests.key_ahead, dim, next);
    prefetch_row(requests.value, requests.value_dim, next);
  }
  store_dot_products<kRows, kKeys>(acc[0], acc_t(1), scores, ld_s);
  // The ragged end in scalars: as masked vectors, GCC kept acc on the stack (zeroed and
  // stored for every key) to share it between the two loops.
  for (; d < dim; ++d) {
    for (int j = 0; j < kKeys; ++j) {
      for (int r = 0; r < kRows; ++r) scores[r * ld_s + j] += q[r * ld_q + d] * static_cast<acc_t>(keys[j][d]);
    }
  }
}

// S[r, c] = scale q[r] . k_c for r < kRows and the tile's keys c < cols (s_tile [kRows, ld_s]),
// the keys read in place; q is fp32 (pre-scaled, scale 1) or, for kScoreByBf16Dots, bf16. Value
// row value_rows[c] (c < values_listed) is requested as key c is scored: the tile's own (below)
// or the next tile's (kValuesRequestedTileAhead). Its own so that the rest of the score pass
// lies between the request and the value pass's read: requested kPrefetchRows rows ahead within
// the value pass, whose slices go through a row in a few cycles, the requests came too late and
// half of decode's samples (perf) sat on value loads. Key rows kPrefetchRows ahead are requested
// here too, unless the value pass requests them (value_pass_requests_keys). All rows are scored
// at once, each key read once: on AVX2 up to 8 rows' accumulators (one chain each) fit the
// registers. Measured on Zen 1 against 8 fp32 rows scored as two groups of 4, each reading the
// keys (the kernel called directly, 8 sequences x context 4096, medians of 5 rounds alternating
// the builds): 64q/8kv decode on one core 5.67 -> 6.17 GB/s from cache and 5.27 -> 5.73 from
// memory, on two 10.4 -> 11.0; 5-7 rows (40-56 query heads over 8 kv heads) 5-9% faster from
// cache. `score` is inlined by force: in the extension GCC left it out of line for 3 to 8 rows,
// a call per key (it did inline it in a standalone build of the kernel), and 64q/8kv through the
// op read 7.1-7.6 GB/s so against 9.8-11.0 inlined.
template <int kRows, typename q_t, typename scalar_t, typename acc_t>
void score_tile(const q_t* q, int64_t ld_q, acc_t scale, const TileRows<scalar_t>& keys,
                const scalar_t* const* value_rows, int64_t values_listed, int64_t cols, int64_t dim, int64_t dim_v,
                acc_t* s_tile, int64_t ld_s) {
  auto score = [&](auto kKeys, int64_t c) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr bool kInLoop = kRequestRowsInScoreLoop<scalar_t, kKeys>;
    constexpr bool kKeysAhead = !value_pass_requests_keys<scalar_t>(kRows);
    constexpr ScoreLoopRequests kRequests = !kInLoop    ? ScoreLoopRequests::kNone
                                            : kKeysAhead ? ScoreLoopRequests::kKeyAheadAndValue
                                                         : ScoreLoopRequests::kValue;
    RowRequests<scalar_t> requests{};
    if constexpr (kInLoop) {
      requests = {keys.row_ahead(c), value_rows[c], dim_v};
    } else {
      for (int j = 0; j < kKeys; ++j) {
        if constexpr (kKeysAhead) keys.prefetch(c + j, dim);
        if (c + j < values_listed) prefetch_row(value_rows[c + j], dim_v);
      }
    }
    score_keys<kRows, kKeys, kRequests>(q, ld_q, keys.rows + c, dim, scale, s_tile + c, ld_s, requests);
  };
  constexpr int kKeys = kKeysPerStep<kRows>;
  int64_t c = 0;
  for (; c + kKeys <= cols; c += kKeys) score(std::integral_constant<int, kKeys>{}, c);
  for (; c < cols; ++c) score(std::integral_constant<int, 1>{}, c);
}

// O[r] += sum over c < cols of P[r, c] v_c for r < kRows, on O's columns [d0, d0 + kVectors
// vectors): O's slice stays in registers while the tile's values pass by. kFull: the slice
// lies inside dim; otherwise its vectors are cut at dim (lanes past it read and add 0). Full
// slices are their own instantiation so that their loads carry no lane-count checks (GCC
// kept a compare and branch per load in the loop over keys). kRequestAhead: at key c, bytes
// `share` of ahead's row c.
template <int kRows, int kVectors, bool kFull, bool kRequestAhead, typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE void accumulate_value_slice(const acc_t* p_tile, int64_t ld_p, const scalar_t* const* value_rows,
                                              int64_t cols, int64_t dim, int64_t d0, acc_t* o, int64_t ld_o,
                                              const SweepRequests<scalar_t>& ahead,
                                              std::pair<int64_t, int64_t> share) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t kWidth = Vec::size();
  int64_t width[kVectors];  // valid lanes of each vector of the slice (0 past dim)
  for (int j = 0; j < kVectors; ++j) width[j] = kFull ? kWidth : std::clamp<int64_t>(dim - d0 - j * kWidth, 0, kWidth);
  Vec acc[kRows * kVectors];  // acc[r * kVectors + j]
  unrolled<kRows * kVectors>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr int r = i / kVectors, j = i % kVectors;
    acc[i] = Vec::loadu(o + r * ld_o + d0 + j * kWidth, width[j]);
  });
  for (int64_t c = 0; c < cols; ++c) {
    if constexpr (kRequestAhead) {
      if (c < ahead.count) request_bytes(ahead.rows[c], share.first, share.second);
    }
    Vec v[kVectors];
    if constexpr (kWidenInPairs<scalar_t>) {
      static_assert(kVectors % 2 == 0, "pairs of vectors");
      unrolled<kVectors / 2>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
        const scalar_t* pair = value_rows[c] + d0 + 2 * j * kWidth;
        if (kFull || width[2 * j + 1] == kWidth) {  // a whole group of 16, in O's pairs order
          load_two_vectors(pair, v[2 * j], v[2 * j + 1]);
        } else {
          v[2 * j] = load_as<acc_t>(pair, width[2 * j]);
          v[2 * j + 1] = load_as<acc_t>(pair + kWidth, width[2 * j + 1]);
        }
      });
    } else {
      unrolled<kVectors>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
        v[j] = load_as<acc_t>(value_rows[c] + d0 + j * kWidth, width[j]);
      });
    }
    unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
      const Vec weight(p_tile[r * ld_p + c]);
      unrolled<kVectors>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
        acc[r * kVectors + j] = at::vec::fmadd(weight, v[j], acc[r * kVectors + j]);
      });
    });
  }
  unrolled<kRows * kVectors>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr int r = i / kVectors, j = i % kVectors;
    acc[i].store(o + r * ld_o + d0 + j * kWidth, width[j]);
  });
}

// Vectors per O slice for kRows rows: 4 where the accumulators, value vectors and broadcast
// weight all fit the vector registers, else 2. On AVX2, 4 rows x 4 vectors spilled four
// accumulators to the stack, loaded and stored for every key (2 vectors: llama2-70b fp32
// decode 1.06x, 32q/8kv bf16 1.05x). 8 bf16 rows not widened in pairs keep 2 vectors and a
// few spills: with 1, each FMA needs a broadcast weight of its own and the loads outnumber
// the FMAs (3% slower).
template <int kRows>
constexpr int kValueVectors = kRows * 4 + 4 + 1 <= kVectorRegisters ? 4 : 2;

// O[r] += sum over c < cols of P[r, c] v_c for r < kRows, reading the tile's value rows in
// place (score_tile requested them), a group of rows and a slice of O at a time. Where the
// value pass requests the next tile's keys (value_pass_requests_keys), `next_keys`' lines are
// requested spread over the pass.
template <int kRows, typename scalar_t, typename acc_t>
void accumulate_values(const acc_t* p_tile, int64_t ld_p, const scalar_t* const* value_rows, int64_t cols,
                       int64_t dim, acc_t* o, int64_t ld_o, const SweepRequests<scalar_t>& next_keys) {
  // Rows per group: kValueRowGroup's, but 8 rows of a cache widened in pairs go as two groups of
  // 4, whose accumulators fit the registers, as reading each value twice costs only a load
  // and two bit operations more (64q/8kv bf16 decode on Zen 1, medians of 8 rounds on two
  // cores: 6.34 against 6.08 GB/s; 5 to 7 rows lost 3-9% split).
  constexpr int kGroupRows =
      kWidenInPairs<scalar_t> && kRows == 8 ? 4 : std::min(kRows, kValueRowGroup<scalar_t, acc_t>);
  constexpr int kVectors = kValueVectors<kGroupRows>;
  constexpr int kGroups = ceil_div(kRows, kGroupRows);
  constexpr bool kRequestAhead = value_pass_requests_keys<scalar_t>(kRows);
  const int64_t slice_width = kVectors * at::vec::Vectorized<acc_t>::size();
  const int64_t sweeps = ceil_div(dim, slice_width) * kGroups;
  auto slice = [&](auto kFull, int64_t d0) C10_ALWAYS_INLINE_ATTRIBUTE {
    unrolled<kGroups>([&](auto group) C10_ALWAYS_INLINE_ATTRIBUTE {
      constexpr int r0 = group * kGroupRows;
      accumulate_value_slice<std::min(kGroupRows, kRows - r0), kVectors, kFull, kRequestAhead>(
          p_tile + r0 * ld_p, ld_p, value_rows, cols, dim, d0, o + r0 * ld_o, ld_o, next_keys,
          next_keys.share(d0 / slice_width * kGroups + group, sweeps));
    });
  };
  int64_t d0 = 0;
  for (; d0 + slice_width <= dim; d0 += slice_width) slice(std::true_type{}, d0);
  if (d0 < dim) slice(std::false_type{}, d0);
}

// Calls kernel(std::integral_constant<int, rows>) for rows in [1, kDirectRows].
template <typename Kernel>
void dispatch_direct_rows(int64_t rows, Kernel&& kernel) {
  switch (rows) {
    case 1: return kernel(std::integral_constant<int, 1>{});
    case 2: return kernel(std::integral_constant<int, 2>{});
    case 3: return kernel(std::integral_constant<int, 3>{});
    case 4: return kernel(std::integral_constant<int, 4>{});
    case 5: return kernel(std::integral_constant<int, 5>{});
    case 6: return kernel(std::integral_constant<int, 6>{});
    case 7: return kernel(std::integral_constant<int, 7>{});
    default: return kernel(std::integral_constant<int, kDirectRows>{});
  }
}

// A kv head's part of a task: its tile rows' queries, output and softmax state.
template <typename scalar_t, typename acc_t>
struct HeadState {
  acc_t* q;             // [rows, ld_d], pre-scaled
  scalar_t* q_raw;      // [rows, ld_d]: q's rows as given, for kScoreByBf16Dots
  acc_t* o;             // [rows, ld_dv]
  acc_t* row_max_log2;  // [rows]
  acc_t* row_sum;       // [rows]
};

template <typename scalar_t>
void paged_attention_kernel(const PagedAttentionParams& p) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t kBlockK = kKeyBlock;
  constexpr acc_t kMinusInf = -std::numeric_limits<acc_t>::infinity();
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t queries_per_tile = paged_queries_per_tile(p);
  const int64_t tile_rows = paged_task_rows(p);
  const int64_t q_chunks = ceil_div(std::max<int64_t>(p.max_queries_per_seq, 1), queries_per_tile);
  const int64_t splits = p.num_kv_splits;
  const int64_t heads_per_task = std::clamp<int64_t>(p.kv_heads_per_task, 1, p.num_kv_heads);
  const int64_t head_groups = ceil_div(p.num_kv_heads, heads_per_task);
  const int64_t ld_d = round_up(p.head_dim, Vec::size());
  const int64_t ld_dv = round_up(p.head_dim_v, Vec::size());
  const int64_t head_state_size = 2 * tile_rows * ld_d + tile_rows * ld_dv + 2 * tile_rows;
  const int64_t scratch_size = heads_per_task * head_state_size + p.head_dim * kBlockK + kBlockK * ld_dv +
                               tile_rows * kBlockK + kBlockK * p.head_dim;
  const scalar_t* k_cache = static_cast<const scalar_t*>(p.k_cache);
  const scalar_t* v_cache = static_cast<const scalar_t*>(p.v_cache);
#if defined(CPU_CAPABILITY_AVX512)
  const bool bf16_dots = kScoreByBf16Dots<scalar_t> && avx512_bf16_enabled();
#else
  constexpr bool bf16_dots = false;
#endif

  at::parallel_for(0, p.batch * head_groups * q_chunks * splits, 1, [&](int64_t begin, int64_t end) {
    acc_t* head_states = thread_scratch<acc_t>(scratch_size);  // [heads_per_task, head_state_size]
    acc_t* kt_tile = head_states + heads_per_task * head_state_size;  // [head_dim, kBlockK]
    acc_t* v_tile = kt_tile + p.head_dim * kBlockK;                    // [kBlockK, ld_dv]
    acc_t* s_tile = v_tile + kBlockK * ld_dv;                          // [tile_rows, kBlockK]
    acc_t* staging = s_tile + tile_rows * kBlockK;                     // [kBlockK, head_dim]
    auto head_state = [&](int64_t i) {  // the task's i-th head
      acc_t* base = head_states + i * head_state_size;
      HeadState<scalar_t, acc_t> state;
      state.q = base;
      state.q_raw = reinterpret_cast<scalar_t*>(base + tile_rows * ld_d);
      state.o = base + 2 * tile_rows * ld_d;
      state.row_max_log2 = state.o + tile_rows * ld_dv;
      state.row_sum = state.row_max_log2 + tile_rows;
      return state;
    };

    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / (head_groups * q_chunks * splits);
      const int64_t head_group = task / (q_chunks * splits) % head_groups;
      const int64_t chunk = task / splits % q_chunks;
      const int64_t split = task % splits;
      const int64_t head_begin = head_group * heads_per_task;
      const int64_t head_end = std::min(head_begin + heads_per_task, p.num_kv_heads);
      const int64_t q_begin = p.cu_seqlens_q[seq];
      const int64_t num_queries = p.cu_seqlens_q[seq + 1] - q_begin;
      const int64_t first_query = chunk * queries_per_tile;
      if (first_query >= num_queries) continue;
      const int64_t queries = std::min(queries_per_tile, num_queries - first_query);
      const int64_t rows = queries * group;
      const int64_t seq_len = p.seq_lens[seq];
      // Query i of the sequence is token seq_len - num_queries + i and sees keys up to itself.
      const int64_t first_position = seq_len - num_queries + first_query;
      const int64_t keys = first_position + queries;  // keys the chunk's last query sees
      const int64_t split_keys = round_up(ceil_div(keys, splits), kBlockK);
      const int64_t key_begin = std::min(split * split_keys, keys);
      const int64_t key_end = std::min(key_begin + split_keys, keys);
      const int32_t* block_table = p.block_tables + seq * p.block_table_stride;

      const bool direct = rows <= kDirectRows;
      // The direct path's q and O rows in widen_bf16_pairs' order (kWidenInPairs).
      const bool widen_in_pairs = direct && kWidenInPairs<scalar_t>;
      for (int64_t kv_head = head_begin; kv_head < head_end; ++kv_head) {
        const HeadState<scalar_t, acc_t> state = head_state(kv_head - head_begin);
        // Row r = (query first_query + r / group, head kv_head * group + r % group)
        for (int64_t r = 0; r < rows; ++r) {
          const scalar_t* q_row = static_cast<const scalar_t*>(p.q) +
                                  (q_begin + first_query + r / group) * p.q_strides.token +
                                  (kv_head * group + r % group) * p.q_strides.head;
          if (bf16_dots && direct) {
            std::copy(q_row, q_row + p.head_dim, state.q_raw + r * ld_d);
            continue;
          }
          load_rows(q_row, 0, 1, p.head_dim, state.q + r * ld_d, ld_d, static_cast<acc_t>(p.scale));
          if (widen_in_pairs) reorder_groups_of_16(state.q + r * ld_d, p.head_dim, true);
        }
        std::fill(state.o, state.o + rows * ld_dv, acc_t(0));
        std::fill(state.row_max_log2, state.row_max_log2 + rows, kMinusInf);
        std::fill(state.row_sum, state.row_sum + rows, acc_t(0));
      }

      // The task's items go through its key tiles in order, and within a tile through its
      // heads (plan_paged_tasks): the item after `item`.
      auto following = [&](const WorkItem& item) {
        if (item.kv_head + 1 < head_end) return WorkItem{item.key0, item.cols, item.kv_head + 1};
        const int64_t key0 = item.key0 + kBlockK;
        return WorkItem{key0, std::clamp<int64_t>(key_end - key0, 0, kBlockK), head_begin};
      };
      // rows[0, item.cols) the item's cached rows, then, where `ahead`, up to kPrefetchRows
      // rows of `next` for the loops that request rows that far ahead.
      auto list_rows = [&](const scalar_t* cache, const CacheStrides& strides, const WorkItem& item,
                           const WorkItem& next, bool ahead, TileRows<scalar_t>& listed) {
        cache_rows(cache, strides, block_table, p.block_size, item.kv_head, item.key0, item.cols, listed.rows);
        listed.listed = item.cols;
        if (ahead) {
          const int64_t extra = std::min(kPrefetchRows, next.cols);
          cache_rows(cache, strides, block_table, p.block_size, next.kv_head, next.key0, extra,
                     listed.rows + item.cols);
          listed.listed += extra;
        }
      };

      const bool keys_in_value_pass = direct && value_pass_requests_keys<scalar_t>(rows);
      TileRows<scalar_t> k_rows, v_rows;
      const bool values_ahead = keys_in_value_pass && kValuesRequestedTileAhead;
      const scalar_t* next_values[kBlockK];  // the next item's value rows, where values_ahead
      const WorkItem first{key_begin, std::min(kBlockK, key_end - key_begin), head_begin};
      for (WorkItem item = first; item.cols > 0;) {
        const WorkItem next = following(item);
        const bool is_first = item.key0 == first.key0 && item.kv_head == first.kv_head;
        const int64_t key0 = item.key0, cols = item.cols;
        const HeadState<scalar_t, acc_t> state = head_state(item.kv_head - head_begin);
        // Rows of the next item are listed only for the loops that request them kPrefetchRows
        // ahead: the gathered path's copies, and the direct score pass's keys where the value
        // pass does not request them. The direct path requests value rows as it scores keys.
        // Past the first item, the value pass that requested the keys listed them in k_rows.
        if (!keys_in_value_pass || is_first) {
          list_rows(k_cache, p.k_cache_strides, item, next, !keys_in_value_pass, k_rows);
        }
        if (!values_ahead || is_first) {
          list_rows(v_cache, p.v_cache_strides, item, next, !direct, v_rows);
        } else {
          std::copy(next_values, next_values + cols, v_rows.rows);
          v_rows.listed = cols;
        }
        // The value rows the score pass requests: this item's, or the next item's.
        const scalar_t* const* value_requests = v_rows.rows;
        int64_t values_requested = cols;
        if (values_ahead) {
          values_requested = next.cols;
          cache_rows(v_cache, p.v_cache_strides, block_table, p.block_size, next.kv_head, next.key0, next.cols,
                     next_values);
          value_requests = next_values;
        }
        if (keys_in_value_pass && is_first) {  // no earlier pass requested this item's rows
          for (int64_t i = 0; i < cols; ++i) prefetch_row(k_rows.rows[i], p.head_dim);
          if (values_ahead) {
            for (int64_t i = 0; i < cols; ++i) prefetch_row(v_rows.rows[i], p.head_dim_v);
          }
        }
        if (direct) {
          // S = Q K^T from the cached key rows: no K^T tile to build.
          dispatch_direct_rows(rows, [&](auto kRows) {
            if constexpr (kScoreByBf16Dots<scalar_t>) {
              if (bf16_dots) {
                return score_tile<kRows>(state.q_raw, ld_d, static_cast<acc_t>(p.scale), k_rows, value_requests,
                                         values_requested, cols, p.head_dim, p.head_dim_v, s_tile, kBlockK);
              }
            }
            score_tile<kRows>(state.q, ld_d, acc_t(1), k_rows, value_requests, values_requested, cols, p.head_dim,
                              p.head_dim_v, s_tile, kBlockK);
          });
        } else {
          gather_tile_rows(k_rows, cols, p.head_dim, staging, p.head_dim);
          transpose_tile(staging, p.head_dim, cols, p.head_dim, kt_tile, kBlockK);
          // S = Q K^T   [rows, cols]
          tile_gemm<false>(rows, cols, p.head_dim, state.q, ld_d, kt_tile, kBlockK, s_tile, kBlockK);
        }
        for (int64_t r = 0; r < rows; ++r) {
          acc_t* s = s_tile + r * kBlockK;
          const int64_t visible = std::clamp<int64_t>(first_position + r / group + 1 - key0, 0, cols);
          std::fill(s + visible, s + cols, kMinusInf);  // scores of q pre-scaled on load
        }
        online_softmax_tile(s_tile, kBlockK, rows, cols, state.row_max_log2, state.row_sum, state.o, ld_dv,
                            p.head_dim_v);
        if (direct) {
          SweepRequests<scalar_t> next_keys;
          if (keys_in_value_pass && next.cols > 0) {  // this item's keys are scored: reuse k_rows
            cache_rows(k_cache, p.k_cache_strides, block_table, p.block_size, next.kv_head, next.key0, next.cols,
                       k_rows.rows);
            k_rows.listed = next.cols;
            next_keys = {k_rows.rows, k_rows.listed, p.head_dim};
          }
          // O += P V, the cached value rows read in place.
          dispatch_direct_rows(rows, [&](auto kRows) {
            accumulate_values<kRows>(s_tile, kBlockK, v_rows.rows, cols, p.head_dim_v, state.o, ld_dv, next_keys);
          });
        } else {
          gather_tile_rows(v_rows, cols, p.head_dim_v, v_tile, ld_dv);
          // O += P V   [rows, head_dim_v]
          tile_gemm<true>(rows, p.head_dim_v, cols, s_tile, kBlockK, v_tile, ld_dv, state.o, ld_dv);
        }
        item = next;
      }

      for (int64_t kv_head = head_begin; kv_head < head_end; ++kv_head) {
        const HeadState<scalar_t, acc_t> state = head_state(kv_head - head_begin);
        for (int64_t r = 0; r < rows; ++r) {
          acc_t* o_row = state.o + r * ld_dv;
          if (widen_in_pairs) reorder_groups_of_16(o_row, p.head_dim_v, false);
          const int64_t token = q_begin + first_query + r / group;
          const int64_t head = kv_head * group + r % group;
          const int64_t lse_index = token * p.num_heads + head;
          if (splits == 1) {
            scalar_t* out = static_cast<scalar_t*>(p.out) + token * p.out_strides.token +
                            head * p.out_strides.head;
            static_cast<acc_t*>(p.lse)[lse_index] =
                finish_row(o_row, p.head_dim_v, state.row_max_log2[r] * kLn2, state.row_sum[r], out);
          } else {
            acc_t* partial = static_cast<acc_t*>(p.partial_out) +
                             (split * p.total_q * p.num_heads + lse_index) * p.head_dim_v;
            static_cast<acc_t*>(p.partial_lse)[split * p.total_q * p.num_heads + lse_index] =
                finish_row(o_row, p.head_dim_v, state.row_max_log2[r] * kLn2, state.row_sum[r], partial);
          }
        }
      }
    }
  });
  if (splits == 1) return;

  // Fold the splits' partial results into the output, one (token, head) row at a time.
  at::parallel_for(0, p.total_q * p.num_heads, 64, [&](int64_t begin, int64_t end) {
    acc_t* merged = thread_scratch<acc_t>(p.head_dim_v);
    for (int64_t index = begin; index < end; ++index) {
      const acc_t* partial_out = static_cast<const acc_t*>(p.partial_out);
      const acc_t* partial_lse = static_cast<const acc_t*>(p.partial_lse);
      const int64_t stride = p.total_q * p.num_heads;
      acc_t lse = partial_lse[index];
      std::copy(partial_out + index * p.head_dim_v, partial_out + (index + 1) * p.head_dim_v, merged);
      for (int64_t split = 1; split < splits; ++split) {
        const MergedState<acc_t> state = merge_softmax_states(lse, partial_lse[split * stride + index]);
        const acc_t* other = partial_out + (split * stride + index) * p.head_dim_v;
        at::vec::map2([&state](Vec a, Vec b) { return a * Vec(state.weight_a) + b * Vec(state.weight_b); },
                      merged, merged, other, p.head_dim_v);
        lse = state.lse;
      }
      const int64_t token = index / p.num_heads, head = index % p.num_heads;
      store_row(merged, p.head_dim_v, acc_t(1),
                static_cast<scalar_t*>(p.out) + token * p.out_strides.token + head * p.out_strides.head);
      static_cast<acc_t*>(p.lse)[index] = lse;
    }
  });
}

template <typename scalar_t>
void merge_states_kernel(const MergeStatesParams& p) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  at::parallel_for(0, p.rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const MergedState<acc_t> state = merge_softmax_states(
          static_cast<const acc_t*>(p.lse_a)[row], static_cast<const acc_t*>(p.lse_b)[row]);
      const scalar_t* a = static_cast<const scalar_t*>(p.out_a) + row * p.out_a_stride;
      const scalar_t* b = static_cast<const scalar_t*>(p.out_b) + row * p.out_b_stride;
      scalar_t* out = static_cast<scalar_t*>(p.out) + row * p.out_stride;
      for (int64_t d = 0; d < p.head_dim; ++d) {
        // A side with weight 0 contributes nothing, even when its output holds garbage.
        const acc_t from_a = state.weight_a == acc_t(0) ? acc_t(0) : state.weight_a * static_cast<acc_t>(a[d]);
        const acc_t from_b = state.weight_b == acc_t(0) ? acc_t(0) : state.weight_b * static_cast<acc_t>(b[d]);
        out[d] = static_cast<scalar_t>(from_a + from_b);
      }
      static_cast<acc_t*>(p.lse)[row] = state.lse;
    }
  });
}

void paged_attention(const PagedAttentionParams& params) {
  dispatch_dtype(params.dtype, [&](auto tag) { paged_attention_kernel<decltype(tag)>(params); });
}

void merge_attention_states(const MergeStatesParams& params) {
  dispatch_dtype(params.dtype, [&](auto tag) { merge_states_kernel<decltype(tag)>(params); });
}

}  // namespace CPU_CAPABILITY
}  // namespace mha_ext::cpu
