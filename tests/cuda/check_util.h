// Helpers shared by the C++ kernel checks (sm80_check.cu, sm90_check.cu): CUDA error checking and
// fp16/bf16 <-> float conversion of host buffers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "jfa/params.h"

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      exit(2);                                                                                  \
    }                                                                                           \
  } while (0)

inline float to_float(uint16_t h, jfa::DType dt) {
  if (dt == jfa::DType::kBFloat16) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  __half_raw r;
  r.x = h;
  return __half2float(__half(r));
}

inline uint16_t from_float(float f, jfa::DType dt) {
  uint16_t u;
  if (dt == jfa::DType::kBFloat16) {
    __nv_bfloat16 b = __float2bfloat16(f);
    memcpy(&u, &b, 2);
  } else {
    __half h = __float2half(f);
    memcpy(&u, &h, 2);
  }
  return u;
}
