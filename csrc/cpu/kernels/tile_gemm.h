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
  for (int r = 0; r < kRows; ++r) {
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
  for (int r = 0; r < kRows; ++r) {
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

// One vector column of C for all m rows: the right edge that 4-vector blocks leave over.
template <bool kAccumulate, bool kRagged, bool kTransA, typename T>
void gemm_column(int64_t m, int64_t depth, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
                 int64_t ldc, int width) {
  auto a_rows = [&](int64_t row) { return kTransA ? a + row : a + row * lda; };
  int64_t row = 0;
  for (; row + kBlockRows <= m; row += kBlockRows) {
    gemm_micro_kernel<kBlockRows, 1, kAccumulate, kRagged, kTransA>(depth, a_rows(row), lda, b, ldb,
                                                                    c + row * ldc, ldc, width);
  }
  for (; row < m; ++row) {
    gemm_micro_kernel<1, 1, kAccumulate, kRagged, kTransA>(depth, a_rows(row), lda, b, ldb,
                                                           c + row * ldc, ldc, width);
  }
}

// C[m, n] = A[m, depth] B[depth, n], or C += A B when kAccumulate; with kTransA the A
// argument holds A^T ([depth, m], leading dim lda). Any m, n, depth.
template <bool kAccumulate, bool kTransA = false, typename T>
void tile_gemm(int64_t m, int64_t n, int64_t depth, const T* a, int64_t lda, const T* b,
               int64_t ldb, T* c, int64_t ldc) {
  constexpr int kWidth = at::vec::Vectorized<T>::size();
  auto a_rows = [&](int64_t row) { return kTransA ? a + row : a + row * lda; };
  int64_t col = 0;
  for (; col + kBlockCols * kWidth <= n; col += kBlockCols * kWidth) {
    int64_t row = 0;
    for (; row + kBlockRows <= m; row += kBlockRows) {
      gemm_micro_kernel<kBlockRows, kBlockCols, kAccumulate, false, kTransA>(
          depth, a_rows(row), lda, b + col, ldb, c + row * ldc + col, ldc, kWidth);
    }
    for (; row < m; ++row) {
      gemm_micro_kernel<1, kBlockCols, kAccumulate, false, kTransA>(
          depth, a_rows(row), lda, b + col, ldb, c + row * ldc + col, ldc, kWidth);
    }
  }
  for (; col < n; col += kWidth) {
    const int width = static_cast<int>(n - col < kWidth ? n - col : kWidth);
    if (width == kWidth) {
      gemm_column<kAccumulate, false, kTransA>(m, depth, a, lda, b + col, ldb, c + col, ldc, width);
    } else {
      gemm_column<kAccumulate, true, kTransA>(m, depth, a, lda, b + col, ldb, c + col, ldc, width);
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace mha_ext::cpu
