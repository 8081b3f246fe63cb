// Score modifiers, shared by the CPU and (later) the CUDA kernels: logit soft-capping, an additive
// bias and ALiBi, applied in that order to the scaled logits of visible elements.
//
// Kernels keep logits in log2 units (x2 = x·log2 e, so exp2 gives the softmax). Soft-capping is
// the same map in either unit: c·tanh(x/c)·log2 e = c2·tanh(x2/c2) with c2 = c·log2 e, and its
// derivative 1 − tanh² is what the backward pass multiplies dS by.
#pragma once

#include <cmath>
#include <cstdint>

#include "jfa/host_device.h"
#include "jfa/mask.h"
#include "jfa/params.h"

namespace jfa {

constexpr float kLog2eF = 1.4426950408889634f;

// bias + ALiBi of element (b, n, i, j), natural units.
JFA_HOST_DEVICE float additive_bias(const AttentionParams& p, const SequenceBounds& s, int64_t b,
                                    int64_t n, int64_t i, int64_t j) {
  const MaskParams& m = p.mask;
  float add = 0.f;
  if (m.bias != nullptr) {
    const Strides4& st = m.bias_strides;
    add += m.bias[b * st.batch + n * st.head + i * st.row + j * st.col];
  }
  if (m.alibi_slopes != nullptr) {
    const int64_t d = i + s.offset - j;
    add -= m.alibi_slope(b, n) * static_cast<float>(d < 0 ? -d : d);
  }
  return add;
}

// The modified logit in log2 units for the raw scaled logit x2 (log2 units). When softcap_grad is
// not null it receives d(result)/d(x2) = 1 - tanh² (1 without soft-capping).
JFA_HOST_DEVICE float modify_score(const AttentionParams& p, const SequenceBounds& s, int64_t b,
                                   int64_t n, int64_t i, int64_t j, float x2, float* softcap_grad) {
  if (p.mask.softcap > 0.f) {
    const float c2 = p.mask.softcap * kLog2eF;
    const float t = tanhf(x2 / c2);
    x2 = c2 * t;
    if (softcap_grad != nullptr) *softcap_grad = 1.f - t * t;
  } else if (softcap_grad != nullptr) {
    *softcap_grad = 1.f;
  }
  if (p.mask.bias != nullptr || p.mask.alibi_slopes != nullptr)
    x2 += additive_bias(p, s, b, n, i, j) * kLog2eF;
  return x2;
}

}  // namespace jfa
