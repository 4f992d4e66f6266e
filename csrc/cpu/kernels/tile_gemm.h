#pragma once
// Register-blocked GEMM on small row-major tiles held in per-thread scratch, the one
// matrix primitive of the CPU attention kernels: every product of the forward
// (S = Q K^T, O += P V) and the backward (dP = dO V^T, dV += P^T dO, dK += dS^T Q,
// dQ += dS K) is C = A B or C = A^T B, with B's transposes laid out on load: B is read in
// vectors along its rows, A one broadcast element at a time, so A can be read transposed in
// place.
//
// Included by an ISA translation unit after it defines CPU_CAPABILITY, so the code below
// is compiled once per ISA, in that ISA's namespace.
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

namespace mha_ext::cpu {
inline namespace CPU_CAPABILITY {

// C[kRows, kCols vectors] (+)= A[kRows, depth] B[depth, kCols vectors]. A's element (r, p)
// is a[r * lda + p], or a[p * lda + r] when kTransA (A stored transposed). With kRagged the
// last vector column holds only `last_width` valid lanes (the right edge of C); without it
// every load and store is a full vector.
template <int kRows, int kCols, bool kAccumulate, bool kRagged, bool kTransA, typename T>
inline void gemm_micro_kernel(int64_t depth, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
                              int64_t ldc, int last_width) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int kWidth = Vec::size();
  auto width = [&](int col) { return kRagged && col == kCols - 1 ? last_width : kWidth; };
  Vec acc[kRows][kCols];
  // The loops around the depth loop are unrolled by request: left to GCC, they kept acc in
  // the stack frame, zeroed there before the loop and stored and reloaded after it (48 vector
  // moves around a 64-deep 4 x 4 block's 1024 FMAs, which ran the fp32 forward at 88% of the
  // FMA rate in its products).
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 16
    for (int col = 0; col < kCols; ++col) {
      acc[r][col] = kAccumulate ? Vec::loadu(c + r * ldc + col * kWidth, width(col)) : Vec(T(0));
    }
  }
  // On AVX2 unrolled 4 deep: the loop's own increments and branch cost Zen 1 (256-bit ops
  // split in two, 4 instructions decoded per cycle) 3-4% of a 64 x 64 x 64 tile's FMA rate.
#if defined(CPU_CAPABILITY_AVX2)
#pragma GCC unroll 4
#endif
  for (int64_t p = 0; p < depth; ++p) {
    Vec b_row[kCols];
    for (int col = 0; col < kCols; ++col) {
      b_row[col] = Vec::loadu(b + p * ldb + col * kWidth, width(col));
    }
    for (int r = 0; r < kRows; ++r) {
      const Vec a_value(kTransA ? a[p * lda + r] : a[r * lda + p]);
      for (int col = 0; col < kCols; ++col) {
        acc[r][col] = at::vec::fmadd(a_value, b_row[col], acc[r][col]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 16
    for (int col = 0; col < kCols; ++col) {
      acc[r][col].store(c + r * ldc + col * kWidth, width(col));
    }
  }
}

// Blocks sized to the register file: on AVX-512, 4 x 4 vectors (16 accumulators + 4 B
// vectors + 1 broadcast of 32 registers), each B load feeding 4 FMAs; AVX2's 16 registers
// hold 4 x 2 (11), which ran gpt2-small S 512 fp32 forward 1.25-1.4x faster than 4 x 4. The
// default build keeps 4 x 4: 2 x 2 ran it 3.7x slower.
#if defined(CPU_CAPABILITY_AVX2)
constexpr int kBlockRows = 4;
constexpr int kBlockCols = 2;
#else
constexpr int kBlockRows = 4;
constexpr int kBlockCols = 4;
#endif

// kCols vector columns of C for all m rows, the last of them `last_width` lanes wide when
// kRagged.
template <int kCols, bool kAccumulate, bool kRagged, bool kTransA, typename T>
void gemm_columns(int64_t m, int64_t depth, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
                  int64_t ldc, int last_width) {
  auto a_rows = [&](int64_t row) { return kTransA ? a + row : a + row * lda; };
  int64_t row = 0;
  for (; row + kBlockRows <= m; row += kBlockRows) {
    gemm_micro_kernel<kBlockRows, kCols, kAccumulate, kRagged, kTransA>(
        depth, a_rows(row), lda, b, ldb, c + row * ldc, ldc, last_width);
  }
  for (; row < m; ++row) {
    gemm_micro_kernel<1, kCols, kAccumulate, kRagged, kTransA>(depth, a_rows(row), lda, b, ldb,
                                                               c + row * ldc, ldc, last_width);
  }
}

// The right edge of C that whole kBlockCols-vector blocks leave over: `vectors` (up to
// kBlockCols, the last `last_width` lanes wide) vector columns in one pass over A, so that each
// broadcast of A feeds them all (the banded products of a causal diagonal end 16, 32 or 48 columns
// wide).
template <int kCols, bool kAccumulate, bool kTransA, typename T>
void gemm_edge(int64_t vectors, int last_width, int64_t m, int64_t depth, const T* a, int64_t lda,
               const T* b, int64_t ldb, T* c, int64_t ldc) {
  if constexpr (kCols > 0) {
    if (vectors < kCols) {
      return gemm_edge<kCols - 1, kAccumulate, kTransA>(vectors, last_width, m, depth, a, lda, b,
                                                        ldb, c, ldc);
    }
    constexpr int kWidth = at::vec::Vectorized<T>::size();
    if (last_width == kWidth) {
      gemm_columns<kCols, kAccumulate, false, kTransA>(m, depth, a, lda, b, ldb, c, ldc, kWidth);
    } else {
      gemm_columns<kCols, kAccumulate, true, kTransA>(m, depth, a, lda, b, ldb, c, ldc, last_width);
    }
  }
}

// C[m, n] = A[m, depth] B[depth, n], or C += A B when kAccumulate; with kTransA the A
// argument holds A^T ([depth, m], leading dim lda). Any m, n, depth.
template <bool kAccumulate, bool kTransA = false, typename T>
void tile_gemm(int64_t m, int64_t n, int64_t depth, const T* a, int64_t lda, const T* b,
               int64_t ldb, T* c, int64_t ldc) {
  constexpr int kWidth = at::vec::Vectorized<T>::size();
  int64_t col = 0;
  for (; col + kBlockCols * kWidth <= n; col += kBlockCols * kWidth) {
    gemm_columns<kBlockCols, kAccumulate, false, kTransA>(m, depth, a, lda, b + col, ldb, c + col,
                                                          ldc, kWidth);
  }
  if (col < n) {
    const int64_t vectors = (n - col + kWidth - 1) / kWidth;
    const int last_width = static_cast<int>(n - col - (vectors - 1) * kWidth);
    gemm_edge<kBlockCols, kAccumulate, kTransA>(vectors, last_width, m, depth, a, lda, b + col, ldb,
                                                c + col, ldc);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace mha_ext::cpu
