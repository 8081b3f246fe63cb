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

// Dropout draws 16-bit uniforms: each Philox call gives eight, one per key of 8 neighbouring keys,
// so a kernel makes one call per 8 elements (the calls are the cost of dropout on the GPU). The
// dropout probability is floor(rate · 2^16) / 2^16, within 2^-16 of the rate.
constexpr uint32_t kDropoutKeysPerCall = 8;

// The dropout threshold: an element is dropped when its 16-bit uniform is below it. Computed in
// double from the float32 rate on every path (rate < 1, so it stays below 2^16).
JFA_HOST_DEVICE uint32_t dropout_threshold(float rate) {
  const double t = static_cast<double>(rate) * 65536.0;
  return t >= 65535.0 ? 65535u : static_cast<uint32_t>(t);
}

// The 16-bit uniform of key `key` in a call's words: word (key / 2) % 4, the low half for an even
// key. So word w holds keys 2w and 2w + 1, which are exactly the two keys lane w of an mma quad
// owns in each 8-column block of an accumulator.
JFA_HOST_DEVICE uint32_t dropout_half(const Philox4& words, uint32_t key) {
  return (words.x[(key >> 1) & 3u] >> (16u * (key & 1u))) & 0xFFFFu;
}

// The uniform of attention element (batch, head, query, key): counter (key / 8, query, head,
// batch). `batch` is the batch coordinate the caller's stream assigns (jax_flashattn passes the
// index within the user's batch, so vmap folding keeps every example's mask).
JFA_HOST_DEVICE uint32_t dropout_uniform(uint32_t k0, uint32_t k1, uint32_t batch, uint32_t head, uint32_t query,
                                         uint32_t key) {
  return dropout_half(philox4x32_10(Philox4{{key >> 3, query, head, batch}}, k0, k1), key);
}

#ifdef __CUDACC__
// One stage of the butterfly transposes below, over a pair of word slots (lo, hi): the slot whose
// bit differs from the lane's own bit (hi when own_bit is 0) is sent to the partner lane
// (lane ^ lane_bit) and replaced by the partner's slot of the other bit.
__device__ __forceinline__ void dropout_swap_words(uint32_t& lo, uint32_t& hi, bool own_bit, int lane_bit) {
  const uint32_t got = __shfl_xor_sync(0xffffffffu, own_bit ? lo : hi, lane_bit);
  if (own_bit) lo = got; else hi = got;
}

// The same stage over the halves of two words a and b: each word's half that differs from own_bit
// (the high half when own_bit is 0) goes to the partner, replaced by the partner's other half.
__device__ __forceinline__ void dropout_swap_halves(uint32_t& a, uint32_t& b, bool own_bit, int lane_bit) {
  const uint32_t sent = __byte_perm(a, b, own_bit ? 0x5410u : 0x7632u);  // the halves that leave
  const uint32_t got = __shfl_xor_sync(0xffffffffu, sent, lane_bit);
  a = __byte_perm(a, got, own_bit ? 0x3254u : 0x5410u);
  b = __byte_perm(b, got, own_bit ? 0x3276u : 0x7610u);
}

// The uniforms of the 8 elements a thread holds in two 8-column blocks A and B of an mma
// accumulator (mma.sync m16n8 and wgmma alike: rows r and r + 8, keys 2w and 2w + 1 of each
// block for quad lane w). The quad needs 4 calls, (row r, A), (row r + 8, A), (r, B), (r + 8, B):
// lane w makes call w, and a 4 x 4 transpose of words (two butterfly stages, two shuffles each)
// hands every lane word w of each. `key_a`, `key_b`: a key of each block (its 8 keys start at a
// multiple of 8). Returns (r, A), (r + 8, A), (r, B), (r + 8, B), each word holding the
// uniforms of keys 2w (low half) and 2w + 1. Every lane of the warp calls it together.
__device__ __forceinline__ uint4 dropout_uniforms_rows(uint32_t k0, uint32_t k1, uint32_t batch, uint32_t head,
                                                       uint32_t query_r, uint32_t query_r8, uint32_t key_a,
                                                       uint32_t key_b) {
  const int w = threadIdx.x & 3;
  const Philox4 x = philox4x32_10(Philox4{{((w & 2) ? key_b : key_a) >> 3, (w & 1) ? query_r8 : query_r, head, batch}},
                                  k0, k1);
  uint32_t v0 = x.x[0], v1 = x.x[1], v2 = x.x[2], v3 = x.x[3];  // slot s: word s of call w
  dropout_swap_words(v0, v1, w & 1, 1);
  dropout_swap_words(v2, v3, w & 1, 1);
  dropout_swap_words(v0, v2, w & 2, 2);
  dropout_swap_words(v1, v3, w & 2, 2);
  return make_uint4(v0, v1, v2, v3);  // slot s: word w of call s
}

// The uniforms of the 8 elements a thread holds in two 8-column blocks A and B of a transposed
// wgmma accumulator (the backward's Sᵀ: keys as rows, queries as columns): keys `key` and key + 8
// (rows; the key's place rr in its group of 8 is bits 2..4 of the lane) and queries q and q + 1 of
// each block (q = query_a or query_b, even). The 8 lanes of one lane % 4 hold the same queries and all 16 keys, which take
// 8 calls (2 key groups x 2 queries x 2 blocks): lane rr makes call rr, and a transpose of 8 x 8
// halves (three butterfly stages) hands every lane half rr of each. Returns (key, A), (key + 8, A),
// (key, B), (key + 8, B), each word holding the uniforms of queries q (low half) and q + 1.
// Every lane of the warp calls it together.
__device__ __forceinline__ uint4 dropout_uniforms_transposed(uint32_t k0, uint32_t k1, uint32_t batch, uint32_t head,
                                                             uint32_t query_a, uint32_t query_b, uint32_t key) {
  const int rr = (threadIdx.x >> 2) & 7;
  // Call rr: query (rr & 1) of block rr >> 2, key group (rr >> 1) & 1.
  const uint32_t query = ((rr & 4) ? query_b : query_a) + uint32_t(rr & 1);
  const Philox4 x = philox4x32_10(Philox4{{(key >> 3) + uint32_t((rr >> 1) & 1), query, head, batch}}, k0, k1);
  uint32_t v0 = x.x[0], v1 = x.x[1], v2 = x.x[2], v3 = x.x[3];  // slot s: half s of call rr
  dropout_swap_halves(v0, v1, rr & 1, 4);
  dropout_swap_halves(v2, v3, rr & 1, 4);
  dropout_swap_words(v0, v1, rr & 2, 8);
  dropout_swap_words(v2, v3, rr & 2, 8);
  dropout_swap_words(v0, v2, rr & 4, 16);
  dropout_swap_words(v1, v3, rr & 4, 16);
  return make_uint4(v0, v1, v2, v3);  // slot s: half rr of call s
}

// Keep bits of a word's two uniforms (bit 0: the low half).
__device__ __forceinline__ uint32_t dropout_keep_pair(uint32_t word, uint32_t threshold) {
  return uint32_t((word & 0xFFFFu) >= threshold) | (uint32_t((word >> 16) >= threshold) << 1);
}
#endif

}  // namespace jfa
