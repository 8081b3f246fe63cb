#include "tiles.h"

#include <cstring>

#include "convert.h"

namespace jfa::cpu {
namespace {

// Converts one contiguous row of n elements to float32, times mul.
void convert_row(const void* src, DType dtype, int n, float mul, float* dst) {
  switch (dtype) {
    case DType::kFloat32: {
      const float* s = static_cast<const float*>(src);
      for (int i = 0; i < n; ++i) dst[i] = mul * s[i];
      break;
    }
    case DType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int i = 0; i < n; ++i) dst[i] = mul * half_to_float(s[i]);
      break;
    }
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int i = 0; i < n; ++i) dst[i] = mul * bfloat16_to_float(s[i]);
      break;
    }
  }
}

int element_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

const void* row_pointer(const HeadView& x, int64_t row) {
  const int64_t element = x.offset + row * x.row_stride;
  return static_cast<const char*>(x.base) + element * element_size(x.dtype);
}

}  // namespace

void load_rows(const HeadView& x, int64_t row0, int rows, int dim, float mul, float* dst, int ld,
               int pad_rows) {
  for (int r = 0; r < rows; ++r) {
    float* out = dst + static_cast<int64_t>(r) * ld;
    convert_row(row_pointer(x, row0 + r), x.dtype, dim, mul, out);
    if (ld > dim) std::memset(out + dim, 0, sizeof(float) * (ld - dim));
  }
  if (pad_rows > rows) std::memset(dst + static_cast<int64_t>(rows) * ld, 0, sizeof(float) * ld * (pad_rows - rows));
}

void load_rows_transposed(const HeadView& x, int64_t row0, int rows, int dim, float mul, float* dst,
                          int ld) {
  // Convert a few rows into a small contiguous buffer, then scatter their columns; the buffer keeps
  // the conversion loop contiguous (vectorizable) and the scatter touches each dst line once per pass.
  constexpr int kChunk = 8;
  float buffer[kChunk * 512];
  for (int r0 = 0; r0 < rows; r0 += kChunk) {
    const int chunk = rows - r0 < kChunk ? rows - r0 : kChunk;
    for (int c0 = 0; c0 < dim; c0 += 512) {
      const int width = dim - c0 < 512 ? dim - c0 : 512;
      for (int r = 0; r < chunk; ++r) {
        const char* src = static_cast<const char*>(row_pointer(x, row0 + r0 + r));
        convert_row(src + static_cast<int64_t>(c0) * element_size(x.dtype), x.dtype, width, mul,
                    buffer + r * 512);
      }
      for (int c = 0; c < width; ++c) {
        float* out = dst + static_cast<int64_t>(c0 + c) * ld + r0;
        for (int r = 0; r < chunk; ++r) out[r] = buffer[r * 512 + c];
      }
    }
  }
  if (ld > rows)
    for (int c = 0; c < dim; ++c) std::memset(dst + static_cast<int64_t>(c) * ld + rows, 0, sizeof(float) * (ld - rows));
}

FloatRows rows_as_float(const HeadView& x, int64_t row0, int rows, int dim, int padded_dim, float* scratch) {
  if (x.dtype == DType::kFloat32 && padded_dim == dim)
    return FloatRows{static_cast<const float*>(row_pointer(x, row0)), x.row_stride};
  load_rows(x, row0, rows, dim, 1.f, scratch, padded_dim, rows);
  return FloatRows{scratch, padded_dim};
}

void store_rows(void* base, DType dtype, const Strides& st, int64_t b, int64_t head, int64_t row0,
                int rows, int dim, float mul, const float* src, int ld) {
  const int64_t offset = b * st.batch + head * st.head;
  for (int r = 0; r < rows; ++r) {
    const int64_t element = offset + (row0 + r) * st.row;
    const float* in = src + static_cast<int64_t>(r) * ld;
    switch (dtype) {
      case DType::kFloat32: {
        float* out = static_cast<float*>(base) + element;
        for (int c = 0; c < dim; ++c) out[c] = mul * in[c];
        break;
      }
      case DType::kFloat16: {
        uint16_t* out = static_cast<uint16_t*>(base) + element;
        for (int c = 0; c < dim; ++c) out[c] = float_to_half(mul * in[c]);
        break;
      }
      case DType::kBFloat16: {
        uint16_t* out = static_cast<uint16_t*>(base) + element;
        for (int c = 0; c < dim; ++c) out[c] = float_to_bfloat16(mul * in[c]);
        break;
      }
    }
  }
}

}  // namespace jfa::cpu
