// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the
// counter-based generator behind attention dropout. Host and device share this code, so a dropout
// mask is one pure function of (key, batch, head, query, key position) on every path: the forward
// and backward passes, the CPU and the GPU, regenerate it instead of storing it.
//
// jax_flashattn.dropout re-implements the same stream in NumPy; tests compare the two bit for bit.
#pragma once

#include <cstdint>

#include "jfa/host_device.h"

namespace jfa {

struct Philox4 {
  uint32_t x[4];
};

JFA_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(product >> 32);
  *lo = static_cast<uint32_t>(product);
}

// Four 32-bit random words for `counter` under the 64-bit key (k0, k1).
JFA_HOST_DEVICE Philox4 philox4x32_10(Philox4 counter, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments
  uint32_t c0 = counter.x[0], c1 = counter.x[1], c2 = counter.x[2], c3 = counter.x[3];
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, c0, &hi0, &lo0);
    philox_mulhilo(kM1, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The dropout threshold: an element is dropped when its random word is below it, i.e. with
// probability rate (to 2^-32). Computed in double from the float32 rate on every path.
JFA_HOST_DEVICE uint32_t dropout_threshold(float rate) {
  const double t = static_cast<double>(rate) * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

// The random word of attention element (batch, head, query, key): counter (key / 4, query, head,
// batch), word key % 4 (one Philox call covers four neighbouring keys). `batch` is the batch
// coordinate the caller's stream assigns (jax_flashattn passes the index within the user's
// batch, so vmap folding keeps every example's mask).
JFA_HOST_DEVICE uint32_t dropout_word(uint32_t k0, uint32_t k1, uint32_t batch, uint32_t head,
                                      uint32_t query, uint32_t key) {
  const Philox4 r = philox4x32_10(Philox4{{key >> 2, query, head, batch}}, k0, k1);
  return r.x[key & 3u];
}

#ifdef __CUDACC__
// The dropout words of the 2 x 2 elements a thread holds in an mma accumulator fragment (mma.sync
// m16n8 and wgmma alike: rows r and r + 8, keys j and j + 1 with j even), made with the other lane
// of its pair (lane ^ 1: the same rows, keys j ^ 2 and (j ^ 2) + 1, the same Philox call's other
// two words). The lane whose keys are the group's first two (j % 4 == 0) draws its first row r,
// the other its second row r + 8: `query` is that row. Each hands the other the two words it holds
// keys for: one Philox call and two shuffles per 4 elements, where a call per row and key pair
// would make two. Every lane of the warp calls it together (the shuffles). Returns the words of
// (r, j), (r, j + 1), (r + 8, j), (r + 8, j + 1): those of jfa::dropout_word.
__device__ __forceinline__ uint4 dropout_words_2x2(uint32_t k0, uint32_t k1, uint32_t batch, uint32_t head,
                                                   uint32_t query, uint32_t key) {
  const bool upper = (key & 2u) != 0;  // keys 4g + 2, 4g + 3 of group g: words 2 and 3
  const Philox4 x = philox4x32_10(Philox4{{key >> 2, query, head, batch}}, k0, k1);
  const uint32_t own0 = upper ? x.x[2] : x.x[0], own1 = upper ? x.x[3] : x.x[1];
  const uint32_t give0 = upper ? x.x[0] : x.x[2], give1 = upper ? x.x[1] : x.x[3];
  const uint32_t got0 = __shfl_xor_sync(0xffffffffu, give0, 1), got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
  return upper ? make_uint4(got0, got1, own0, own1) : make_uint4(own0, own1, got0, got1);
}
#endif

}  // namespace jfa
