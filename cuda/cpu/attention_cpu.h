// CPU attention: the FlashAttention-2 algorithm in C++ (tiled, online softmax, never a T×S buffer).
//
// Threads come from std::thread (no OpenMP runtime to ship); JFA_CPU_THREADS overrides the count.
// Both entry points assume the FFI handler has already validated shapes (N % K == 0, H, Hv >= 1)
// and accept empty problems (B, T or S == 0). Rows that see no key give o = 0, lse = -inf, and
// contribute zero gradient.
#pragma once

#include "jfa/params.h"

namespace jfa::cpu {

// Reads q, k, v; writes o and lse (natural log, float32).
void forward(const AttentionParams& p);

// Reads q, k, v, o, lse, dout and dlse (null means a zero cotangent); writes dq, dk, dv.
// Deterministic: dk/dv are reduced per K/V block and dq per query block, without atomics.
void backward(const AttentionParams& p);

}  // namespace jfa::cpu
