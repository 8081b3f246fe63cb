// Loading rows of the sparse-attention tensors (jfa/sparse_params.h layouts) as float32.
#pragma once

#include <cstdint>

#include "jfa/sparse_params.h"
#include "tiles.h"

namespace jfa::cpu {

// The G query heads of key/value head kh at (b, t): dst[g * H + c].
inline void load_query_group(const SparseParams& p, const void* base, int64_t dim, int64_t b, int64_t t,
                             int64_t kh, float* dst) {
  const int64_t G = p.group_size();
  const HeadView view{base, p.dtype, dim, ((b * p.T + t) * p.N + kh * G) * dim};
  load_rows(view, 0, static_cast<int>(G), static_cast<int>(dim), 1.f, dst, static_cast<int>(dim),
            static_cast<int>(G));
}

// Key row s of head kh of batch b: dst[0 .. H).
inline void load_key_row(const SparseParams& p, int64_t b, int64_t s, int64_t kh, float* dst) {
  const HeadView view{p.k, p.dtype, 0, p.k_row(b, s, kh)};
  load_rows(view, 0, 1, static_cast<int>(p.H), 1.f, dst, static_cast<int>(p.H), 1);
}

// Value row s of head kh of batch b, dst[0 .. Hv): from v, or k's first Hv columns when v is null.
inline void load_value_row(const SparseParams& p, int64_t b, int64_t s, int64_t kh, float* dst) {
  const HeadView view = p.v ? HeadView{p.v, p.dtype, 0, p.v_row(b, s, kh)}
                            : HeadView{p.k, p.dtype, 0, p.k_row(b, s, kh)};
  load_rows(view, 0, 1, static_cast<int>(p.Hv), 1.f, dst, static_cast<int>(p.Hv), 1);
}

// Rows [row0, row0 + rows) of a dense [.., dim] tensor from src[r * dim + c], rounded to its dtype.
inline void store_dense_rows(void* base, DType dtype, int64_t dim, int64_t row0, int64_t rows, const float* src) {
  store_rows(base, dtype, Strides{0, dim, 0}, 0, 0, row0, static_cast<int>(rows), static_cast<int>(dim), 1.f,
             src, static_cast<int>(dim));
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace jfa::cpu
