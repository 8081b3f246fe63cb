// Moving tiles between the [batch, row, head, dim] tensors of AttentionParams and float32 scratch.
//
// Every tile is converted to float32 once on load (and rounded once on store), so the microkernels
// see a single dtype. Padding rows / columns are zero-filled so that padded GEMM lanes stay finite.
#pragma once

#include <cstdint>

#include "jfa/params.h"

namespace jfa::cpu {

// Where one (batch, head) slice of a [batch, row, head, dim] tensor lives.
struct HeadView {
  const void* base;
  DType dtype;
  int64_t row_stride;  // elements
  int64_t offset;      // elements, of row 0 of this (batch, head)
};

inline HeadView head_view(const void* base, DType dtype, const Strides& st, int64_t b, int64_t head) {
  return HeadView{base, dtype, st.row, b * st.batch + head * st.head};
}

// dst[r * ld + c] = mul * x[row0 + r][c] for r < rows, c < dim; zero for rows <= r < pad_rows and
// dim <= c < ld.
void load_rows(const HeadView& x, int64_t row0, int rows, int dim, float mul, float* dst, int ld,
               int pad_rows);

// dst[c * ld + r] = mul * x[row0 + r][c] (the tile transposed, [dim][ld]); zero for rows <= r < ld.
void load_rows_transposed(const HeadView& x, int64_t row0, int rows, int dim, float mul, float* dst,
                          int ld);

// A row-major float32 view of rows of a tensor: ld is in elements.
struct FloatRows {
  const float* data;
  int64_t ld;
};

// Rows [row0, row0 + rows) as float32 with at least `padded_dim` readable columns (zero beyond dim).
// float32 inputs whose dim needs no padding are read in place (no copy: K/V tiles are re-read for
// every query block); anything else is converted into scratch[rows][padded_dim].
FloatRows rows_as_float(const HeadView& x, int64_t row0, int rows, int dim, int padded_dim, float* scratch);

// y[row0 + r][c] = mul * src[r * ld + c] for r < rows, c < dim, rounded to y's dtype.
void store_rows(void* base, DType dtype, const Strides& st, int64_t b, int64_t head, int64_t row0,
                int rows, int dim, float mul, const float* src, int ld);

}  // namespace jfa::cpu
