// An 8-float vector type (GCC/Clang vector extensions) and the vector exp2 of the hot loops.
//
// Why vector extensions rather than plain loops: GCC's SLP vectorizer did not reliably keep the
// GEMM accumulator block in registers, and it compiles these types for whatever ISA the enclosing
// target_clones clone has (2×SSE for baseline x86-64, one YMM for AVX2). Only kernels.cc includes
// this header, and every function here must be inlined into a clone (see JFA_CPU_INLINE).
#pragma once

#include <cstdint>
#include <cstring>

// Passing 32-byte vectors by value changes the ABI between ISA levels; harmless here because every
// function is inlined, so silence GCC's note about it.
#pragma GCC diagnostic ignored "-Wpsabi"

#define JFA_CPU_INLINE inline __attribute__((always_inline))

namespace jfa::cpu::simd {

constexpr int kWidth = 8;
typedef float vfloat __attribute__((vector_size(32)));
typedef int32_t vint __attribute__((vector_size(32)));

JFA_CPU_INLINE vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);  // unaligned load without aliasing questions
  return v;
}

JFA_CPU_INLINE void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// A lane-0 shuffle: GCC emits one vbroadcastss for it, while {x, x, ...} or x - vfloat{} (inside
// target_clones functions) were assembled lane by lane with vinsertps.
JFA_CPU_INLINE vfloat broadcast(float x) { return __builtin_shuffle(vfloat{x}, vint{}); }

// exp2, branch-free: x = n + f with n = round(x), |f| <= 1/2; 2^f by a degree-6 polynomial (Cephes
// exp2f coefficients, relative error ~2e-7), 2^n assembled in the exponent bits. x <= -127 (masked
// -inf entries included) gives exactly 0, which fully masked rows need; x >= 127 saturates to 2^127
// (callers pass x <= ~0); nan propagates.
JFA_CPU_INLINE vfloat exp2(vfloat x) {
  // Comparisons ordered so that a nan lane takes the bound: the int conversion below stays defined.
  vfloat clamped = x > -127.f ? x : broadcast(-127.f);
  clamped = clamped < 127.f ? clamped : broadcast(127.f);
  // Round to nearest with the 1.5·2^23 trick (kept by the compiler since we never use -ffast-math).
  const vfloat rounded = (clamped + 12582912.f) - 12582912.f;
  const vfloat f = clamped - rounded;
  vfloat poly = broadcast(1.535336188319500e-4f);
  poly = poly * f + 1.339887440266574e-3f;
  poly = poly * f + 9.618437357674640e-3f;
  poly = poly * f + 5.550332471162809e-2f;
  poly = poly * f + 2.402264791363012e-1f;
  poly = poly * f + 6.931472028550421e-1f;
  poly = poly * f + 1.f;
  // n = -127 gives exponent field 0, i.e. a scale of 0.f: underflow to exactly zero.
  const vint exponent_bits = (__builtin_convertvector(rounded, vint) + 127) << 23;
  const vfloat result = poly * (vfloat)exponent_bits;
  return x == x ? result : x;
}

}  // namespace jfa::cpu::simd
