// Scalar float16 / bfloat16 <-> float32 conversions (round-to-nearest-even on narrowing).
//
// Written by hand so the CPU path depends on nothing beyond the C++17 standard library; tiles are
// converted once on load and once on store, so these are not in the hot loops.
#pragma once

#include <cstdint>
#include <cstring>

namespace jfa::cpu {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf, nan
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// After F. Giesen's float_to_half_fast3_rtne: rebias the exponent and round in integer arithmetic.
inline uint16_t float_to_half(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u)  // inf stays inf, nan stays a (quiet) nan
    return static_cast<uint16_t>(sign | 0x7c00u | (magnitude > 0x7f800000u ? 0x200u : 0u));
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (magnitude < 0x38800000u) {
    // Below the smallest normal half: adding 0.5 puts the half-subnormal unit (2^-24) at the
    // float's last mantissa bit, so the FPU's own round-to-nearest-even does the rounding.
    const float shifted = bits_to_float(magnitude) + 0.5f;
    return static_cast<uint16_t>(sign | (float_to_bits(shifted) - 0x3f000000u));
  }
  const uint32_t mantissa_odd = (magnitude >> 13) & 1u;
  magnitude += 0xc8000fffu + mantissa_odd;  // exponent bias 127 -> 15, plus round-half-even
  return static_cast<uint16_t>(sign | (magnitude >> 13));
}

inline float bfloat16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bfloat16(float f) {
  const uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // nan
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

}  // namespace jfa::cpu
