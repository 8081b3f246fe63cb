#include "kernels.h"

#include <cmath>

#include "simd.h"

// One clone per ISA level, dispatched by the loader (ifunc). x86-64-v3 = AVX2 + FMA + F16C. The
// a * b + c in the loops become FMAs through contraction (-ffp-contract=fast, GCC's default for
// C++ even with -std=c++17). AVX-512 would need 16-wide vectors to pay off, hence no v4 clone.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JFA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define JFA_CPU_CLONES
#endif

namespace jfa::cpu {
namespace {

using simd::vfloat;
constexpr int kW = simd::kWidth;
constexpr int kNV = kColumnMultiple / kW;  // vectors per register block row
constexpr int kMR = 6;  // rows per register block: 6×2 accumulators + 2 B vectors + 1 broadcast <= 16

static_assert(kColumnMultiple % kW == 0, "column padding must hold whole vectors");

// C[MR][16] (+)= A[MR][Kd] · B[Kd][16]: the accumulator block lives in registers for the whole Kd
// loop; A is only ever broadcast, so reading it transposed (kTransA) costs nothing extra.
template <int MR, bool kTransA>
JFA_CPU_INLINE void gemm_block(int Kd, const float* A, long lda, const float* B, long ldb, float* C,
                               long ldc, bool accumulate) {
  vfloat c[MR][kNV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kNV; ++v) c[i][v] = accumulate ? simd::load(C + i * ldc + v * kW) : vfloat{};
  for (int k = 0; k < Kd; ++k) {
    vfloat b[kNV];
    for (int v = 0; v < kNV; ++v) b[v] = simd::load(B + k * ldb + v * kW);
    for (int i = 0; i < MR; ++i) {
      const vfloat a = simd::broadcast(kTransA ? A[k * lda + i] : A[i * lda + k]);
      for (int v = 0; v < kNV; ++v) c[i][v] += a * b[v];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kNV; ++v) simd::store(C + i * ldc + v * kW, c[i][v]);
}

template <bool kTransA>
JFA_CPU_INLINE void gemm_impl(int M, int N, int Kd, const float* A, long lda, const float* B, long ldb,
                              float* C, long ldc, bool accumulate) {
  // Row block i0 starts at A + i0 rows: i0 * lda normally, i0 columns when A is stored transposed.
  auto a_at = [&](int i0) { return kTransA ? A + i0 : A + i0 * lda; };
  for (int j0 = 0; j0 < N; j0 += kColumnMultiple) {
    int i0 = 0;
    for (; i0 + kMR <= M; i0 += kMR)
      gemm_block<kMR, kTransA>(Kd, a_at(i0), lda, B + j0, ldb, C + i0 * ldc + j0, ldc, accumulate);
    const float* a = a_at(i0);
    float* c = C + i0 * ldc + j0;
    switch (M - i0) {
      case 5: gemm_block<5, kTransA>(Kd, a, lda, B + j0, ldb, c, ldc, accumulate); break;
      case 4: gemm_block<4, kTransA>(Kd, a, lda, B + j0, ldb, c, ldc, accumulate); break;
      case 3: gemm_block<3, kTransA>(Kd, a, lda, B + j0, ldb, c, ldc, accumulate); break;
      case 2: gemm_block<2, kTransA>(Kd, a, lda, B + j0, ldb, c, ldc, accumulate); break;
      case 1: gemm_block<1, kTransA>(Kd, a, lda, B + j0, ldb, c, ldc, accumulate); break;
      default: break;
    }
  }
}

}  // namespace

JFA_CPU_CLONES
void gemm(int M, int N, int Kd, const float* A, long lda, const float* B, long ldb, float* C, long ldc,
          bool accumulate) {
  gemm_impl<false>(M, N, Kd, A, lda, B, ldb, C, ldc, accumulate);
}

JFA_CPU_CLONES
void gemm_at(int M, int N, int Kd, const float* A, long lda, const float* B, long ldb, float* C, long ldc,
             bool accumulate) {
  gemm_impl<true>(M, N, Kd, A, lda, B, ldb, C, ldc, accumulate);
}

JFA_CPU_CLONES
void softmax_step_transposed(float* st, int keys, int queries, int ld, float* m, float* l, float* acc,
                             int acc_cols, int acc_ld) {
  for (int c = 0; c < queries; c += kW) {
    vfloat block_max = simd::broadcast(-INFINITY);
    for (int r = 0; r < keys; ++r) {
      const vfloat x = simd::load(st + static_cast<long>(r) * ld + c);
      block_max = x > block_max ? x : block_max;
    }
    const vfloat m_old = simd::load(m + c);
    const vfloat m_new = block_max > m_old ? block_max : m_old;
    // A query with nothing visible yet keeps m = -inf; subtract 0 so -inf - -inf is not nan.
    const vfloat m_use = m_new == -INFINITY ? vfloat{} : m_new;
    const vfloat alpha = simd::exp2(m_old - m_use);
    vfloat sum{};
    for (int r = 0; r < keys; ++r) {
      float* row = st + static_cast<long>(r) * ld + c;
      const vfloat p = simd::exp2(simd::load(row) - m_use);
      simd::store(row, p);
      sum += p;
    }
    simd::store(l + c, simd::load(l + c) * alpha + sum);
    simd::store(m + c, m_new);
    for (int j = 0; j < kW; ++j) {
      if (alpha[j] == 1.f) continue;
      float* a = acc + static_cast<long>(c + j) * acc_ld;
      for (int v = 0; v < acc_cols; v += kW) simd::store(a + v, simd::load(a + v) * alpha[j]);
    }
  }
}

JFA_CPU_CLONES
void exp2_minus_row(float* s, int rows, int cols, int ld, const float* row_offset) {
  for (int r = 0; r < rows; ++r) {
    float* row = s + static_cast<long>(r) * ld;
    const float offset = row_offset[r];
    for (int c = 0; c < cols; c += kW) simd::store(row + c, simd::exp2(simd::load(row + c) - offset));
  }
}

JFA_CPU_CLONES
void exp2_minus_col(float* s, int rows, int cols, int ld, const float* col_offset) {
  for (int r = 0; r < rows; ++r) {
    float* row = s + static_cast<long>(r) * ld;
    for (int c = 0; c < cols; c += kW)
      simd::store(row + c, simd::exp2(simd::load(row + c) - simd::load(col_offset + c)));
  }
}

JFA_CPU_CLONES
void ds_from_dp_row(float* dp, const float* p, int rows, int cols, int ld, const float* row_d) {
  for (int r = 0; r < rows; ++r) {
    float* out = dp + static_cast<long>(r) * ld;
    const float* in = p + static_cast<long>(r) * ld;
    const float d = row_d[r];
    for (int c = 0; c < cols; c += kW)
      simd::store(out + c, simd::load(in + c) * (simd::load(out + c) - d));
  }
}

JFA_CPU_CLONES
void ds_from_dp_col(float* dp, const float* p, int rows, int cols, int ld, const float* col_d) {
  for (int r = 0; r < rows; ++r) {
    float* out = dp + static_cast<long>(r) * ld;
    const float* in = p + static_cast<long>(r) * ld;
    for (int c = 0; c < cols; c += kW)
      simd::store(out + c, simd::load(in + c) * (simd::load(out + c) - simd::load(col_d + c)));
  }
}

}  // namespace jfa::cpu
