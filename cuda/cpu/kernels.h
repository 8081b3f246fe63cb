// Float32 microkernels of the CPU path: tile GEMMs, exp2, and the softmax / dS updates.
//
// These are the only hot loops; kernels.cc compiles each for AVX2+FMA and baseline x86-64
// (target_clones, chosen at load time), so one wheel runs everywhere and uses FMA where present.
// Leading dimensions are in elements. Column counts (N, cols, queries, acc_cols) are multiples of
// kColumnMultiple: tiles are zero-padded to it, and B/C rows must be readable/writable that far.
#pragma once

namespace jfa::cpu {

constexpr int kColumnMultiple = 16;

// Width of a zero-padded tile holding n columns.
inline int round_up_columns(int n) { return (n + kColumnMultiple - 1) / kColumnMultiple * kColumnMultiple; }

// C[M][N] = (accumulate ? C : 0) + A·B with A[M][Kd] row-major (A[i * lda + k]) and B[Kd][N]
// row-major. M and Kd are arbitrary.
void gemm(int M, int N, int Kd, const float* A, long lda, const float* B, long ldb, float* C, long ldc,
          bool accumulate);

// The same with A stored transposed: A(i, k) = A[k * lda + i], i.e. C (+)= Aᵀ·B for A[Kd][M].
void gemm_at(int M, int N, int Kd, const float* A, long lda, const float* B, long ldb, float* C, long ldc,
             bool accumulate);

// One online-softmax step (log2 domain) on a transposed scores tile st[keys][queries] (masked
// entries -inf): per query column, updates the running max m and sum l, overwrites st with
// P = exp2(st - m_new), and rescales row q of acc[queries][acc_cols] by exp2(m_old - m_new).
void softmax_step_transposed(float* st, int keys, int queries, int ld, float* m, float* l, float* acc,
                             int acc_cols, int acc_ld);

// s[r][c] = exp2(s[r][c] - row_offset[r]) for r < rows, c < cols.
void exp2_minus_row(float* s, int rows, int cols, int ld, const float* row_offset);

// s[r][c] = exp2(s[r][c] - col_offset[c]) for r < rows, c < cols.
void exp2_minus_col(float* s, int rows, int cols, int ld, const float* col_offset);

// dp[r][c] = p[r][c] * (dp[r][c] - row_d[r]): turns dP into dS (softmax backward), row-wise D.
void ds_from_dp_row(float* dp, const float* p, int rows, int cols, int ld, const float* row_d);

// dp[r][c] = p[r][c] * (dp[r][c] - col_d[c]): the same on a transposed tile.
void ds_from_dp_col(float* dp, const float* p, int rows, int cols, int ld, const float* col_d);

}  // namespace jfa::cpu
