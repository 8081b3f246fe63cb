// What the A/B harnesses of the Hopper kernels share (ab_sm90_bwd.cu, ab_sm90_fwd_masks.cu): error
// checks, the SM count api.cu would give, random inputs made on the device, bit-packed masks of a
// few patterns and result digests.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cutlass/numeric_types.h>

#include "jfa/mask_packing.h"

// The head dim and the tree's name, set by ab_sm90_bwd.sh.
#ifndef AB_HDIM
#define AB_HDIM 128
#endif
#ifndef AB_ROOT
#define AB_ROOT "?"
#endif

#define CK(x)                                                                    \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      std::printf("CUDA error %s at line %d\n", cudaGetErrorString(e_), __LINE__); \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

namespace jfa::sm90 {
// api.cu's, which the harnesses do not link.
int num_sms() {
  int device = 0, n = 1;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  return n;
}
}  // namespace jfa::sm90

namespace ab {

using Element = cutlass::bfloat16_t;

// Normal-ish values (the sum of four hashed uniforms, centred and scaled to unit variance) made on
// the device: host generation of 16k x 2048 elements per buffer took most of a run.
__global__ void fill_random(Element* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9E3779B9u ^ seed * 0x85EBCA6Bu ^ uint32_t(i >> 32);
    float sum = 0.f;
    for (int k = 0; k < 4; ++k) {
      h ^= h >> 16; h *= 0x7FEB352Du; h ^= h >> 15; h *= 0x846CA68Bu; h ^= h >> 16;
      sum += float(h) * 2.3283064e-10f;
    }
    x[i] = Element((sum - 2.f) * 1.7320508f);
  }
}

// Masks [T, S] shared by every batch element and head: the causal triangle; a tenth or half of the
// 128 x 128 blocks, chosen at random (block_mask's blocks); every element at random with p 0.5
// (every tile partial); every element visible (the mask kernel's own cost beside the plain one).
enum class MaskPattern { kCausal, kBlock50, kBlock10, kRandom50, kDense };

inline uint32_t mix(uint32_t h) {
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  return h;
}

// The mask as jax_flashattn.pack_mask lays it out (jfa/packed_mask.h): its bits and tile summaries
// on the device; *bits_out, *tiles_out: the buffers to free.
inline jfa::PackedMaskView packed_mask(MaskPattern pattern, int T, int S, uint32_t** bits_out, uint8_t** tiles_out) {
  const int64_t words = jfa::mask_words(S), chunks = jfa::mask_chunks(S), row_blocks = jfa::mask_row_blocks(T);
  std::vector<uint32_t> bits(size_t(T) * words, 0u);
  const int blocks_per_row = (S + 127) / 128;
  for (int i = 0; i < T; ++i)
    for (int j = 0; j < S; ++j) {
      const uint32_t block = mix(uint32_t(i / 128 * blocks_per_row + j / 128) * 0x9E3779B9u);
      bool visible = true;
      switch (pattern) {
        case MaskPattern::kCausal: visible = j <= i; break;
        case MaskPattern::kBlock50: visible = (block & 1u) != 0; break;
        case MaskPattern::kBlock10: visible = block % 10u == 0; break;
        case MaskPattern::kRandom50: visible = (mix((uint32_t(i) * 0x9E3779B9u) ^ (uint32_t(j) * 0x85EBCA6Bu)) & 1u) != 0; break;
        case MaskPattern::kDense: break;
      }
      const int x = j % jfa::kMaskChunkKeys;
      if (visible)
        bits[size_t(i) * words + (j / jfa::kMaskChunkKeys) * jfa::kMaskChunkWords + jfa::mask_word_of_key(x)] |=
            1u << jfa::mask_bit_of_key(x);
    }
  std::vector<uint8_t> tiles(size_t(row_blocks) * chunks);
  for (int64_t rb = 0; rb < row_blocks; ++rb)
    for (int64_t c = 0; c < chunks; ++c) tiles[rb * chunks + c] = uint8_t(jfa::summarize_mask_tile(bits.data(), T, S, rb, c));
  CK(cudaMalloc(bits_out, bits.size() * 4));
  CK(cudaMemcpy(*bits_out, bits.data(), bits.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(tiles_out, tiles.size()));
  CK(cudaMemcpy(*tiles_out, tiles.data(), tiles.size(), cudaMemcpyHostToDevice));
  jfa::PackedMaskView m;  // broadcast over batch and heads: strides 0
  m.bits = *bits_out;
  m.tiles = *tiles_out;
  m.words = words;
  m.chunks = chunks;
  m.row_blocks = row_blocks;
  return m;
}

// The fraction of pairs a pattern leaves visible on T = S (for useful FLOPs; the random ones'
// expected value).
inline double mask_density(MaskPattern pattern) {
  switch (pattern) {
    case MaskPattern::kCausal: return 0.5;
    case MaskPattern::kBlock50: return 0.5;
    case MaskPattern::kBlock10: return 0.1;
    case MaskPattern::kRandom50: return 0.5;
    case MaskPattern::kDense: return 1.0;
  }
  return 1.0;
}

// Milliseconds of `rounds` launches after 3 warm-up ones, each timed alone by events, sorted.
template <typename Launch>
std::vector<float> time_launches(Launch&& launch, cudaStream_t stream, int rounds) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) CK(launch());
  std::vector<float> ms;
  for (int r = 0; r < rounds; ++r) {
    CK(cudaEventRecord(e0, stream));
    CK(launch());
    CK(cudaEventRecord(e1, stream));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms;
}

// FNV-1a over a device buffer's bytes: two trees that compute the same print the same.
inline uint64_t digest(const void* device, size_t bytes) {
  std::vector<unsigned char> host(bytes);
  CK(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost));
  uint64_t d = 1469598103934665603ull;
  for (unsigned char c : host) d = (d ^ c) * 1099511628211ull;
  return d;
}

}  // namespace ab
