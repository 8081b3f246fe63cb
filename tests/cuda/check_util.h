// Helpers shared by the C++ kernel checks (sm80_check.cu, sm90_check.cu): CUDA error checking and
// fp16/bf16 <-> float conversion of host buffers; the segment-id summaries; boolean masks with
// empty, full and mixed tiles, bit-packed.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "jfa/mask_packing.h"
#include "jfa/packed_mask.h"
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

// The segment-id summaries of jax_flashattn/_segment_chunks.py (jfa::MaskParams::q_segment_chunks),
// computed the same way on the host: per chunk of kSegmentChunk positions of `ids` ([B, len]),
// (min id, max id, begin, end, run begin, run end, match begin, match end) with begin / end the
// suffix min / prefix max of the first / end position of `other` ([B, other_len]) in chunks whose
// id range overlaps, [run begin, run end) the maximal run of one-id chunks with the chunk's id
// around it, and [match begin, match end) the other side's such run with the chunk's one id at
// other chunk begin / 16 or the next one (else empty).
inline std::vector<int32_t> segment_chunks(const std::vector<int32_t>& ids, int len,
                                           const std::vector<int32_t>& other, int other_len, int B) {
  constexpr int C = jfa::kSegmentChunk;
  auto ranges = [&](const std::vector<int32_t>& v, int n, int b) {
    std::vector<std::pair<int32_t, int32_t>> r;
    for (int c = 0; c < n; c += C) {
      int32_t lo = INT32_MAX, hi = INT32_MIN;
      for (int i = c; i < std::min(n, c + C); ++i) {
        lo = std::min(lo, v[size_t(b) * n + i]);
        hi = std::max(hi, v[size_t(b) * n + i]);
      }
      r.emplace_back(lo, hi);
    }
    return r;
  };
  std::vector<int32_t> out;
  for (int b = 0; b < B; ++b) {
    const auto mine = ranges(ids, len, b), theirs = ranges(other, other_len, b);
    const int n = int(mine.size());
    std::vector<int32_t> first(n, other_len), end(n, 0);
    for (int c = 0; c < n; ++c)
      for (int o = 0; o < int(theirs.size()); ++o)
        if (theirs[o].first <= mine[c].second && theirs[o].second >= mine[c].first) {
          first[c] = std::min(first[c], o * C);
          end[c] = std::max(end[c], std::min((o + 1) * C, other_len));
        }
    for (int c = n - 2; c >= 0; --c) first[c] = std::min(first[c], first[c + 1]);
    for (int c = 1; c < n; ++c) end[c] = std::max(end[c], end[c - 1]);
    auto runs = [&](const std::vector<std::pair<int32_t, int32_t>>& r, int length) {
      std::vector<std::pair<int32_t, int32_t>> out_runs;
      auto same = [&](int o, int c) { return r[o].first == r[o].second && r[o].first == r[c].first; };
      for (int c = 0; c < int(r.size()); ++c) {
        int run_begin = c * C, run_end = c * C;
        if (r[c].first == r[c].second) {
          int a = c, e = c;
          while (a > 0 && same(a - 1, c)) --a;
          while (e + 1 < int(r.size()) && same(e + 1, c)) ++e;
          run_begin = a * C;
          run_end = std::min((e + 1) * C, length);
        }
        out_runs.emplace_back(run_begin, run_end);
      }
      return out_runs;
    };
    const auto my_runs = runs(mine, len), their_runs = runs(theirs, other_len);
    for (int c = 0; c < n; ++c) {
      std::pair<int32_t, int32_t> match{0, 0};
      if (mine[c].first == mine[c].second)
        for (int k = first[c] / C; k <= first[c] / C + 1 && k < int(theirs.size()); ++k)
          if (theirs[k].first == theirs[k].second && theirs[k].first == mine[c].first) {
            match = their_runs[k];
            break;
          }
      out.insert(out.end(), {mine[c].first, mine[c].second, first[c], end[c], my_runs[c].first, my_runs[c].second,
                             match.first, match.second});
    }
  }
  return out;
}

// A boolean mask [B, 1, T, S] (one byte per element, nonzero = visible) whose 64 x 128 tiles are
// each empty, full or mixed (`visible` of 1000 kept) in turn with the dice, so that the kernels'
// skipping of empty tiles and their untested full tiles are checked as well as the bits.
template <typename Rng>
inline std::vector<uint8_t> tiled_random_mask(int B, int T, int S, int visible, Rng& rng) {
  std::vector<uint8_t> mask(size_t(B) * T * S);
  const int row_blocks = int(jfa::mask_row_blocks(T)), chunks = int(jfa::mask_chunks(S));
  for (int b = 0; b < B; ++b)
    for (int rb = 0; rb < row_blocks; ++rb)
      for (int c = 0; c < chunks; ++c) {
        const int kind = int(rng() % 3);  // 0 empty, 1 full, 2 mixed
        for (int i = rb * jfa::kMaskTileRows; i < std::min(T, (rb + 1) * jfa::kMaskTileRows); ++i)
          for (int j = c * jfa::kMaskChunkKeys; j < std::min(S, (c + 1) * jfa::kMaskChunkKeys); ++j)
            mask[(size_t(b) * T + i) * S + j] = kind == 1 || (kind == 2 && int(rng() % 1000) < visible);
      }
  return mask;
}

// That mask bit-packed with its tile summaries, as jax_flashattn's pack kernel writes them
// (jfa/mask_packing.h), and a view of a copy of the two arrays (broadcast over heads).
struct PackedMaskHost {
  std::vector<uint32_t> bits;
  std::vector<uint8_t> tiles;
};

inline PackedMaskHost pack_mask_host(const std::vector<uint8_t>& mask, int B, int T, int S) {
  const jfa::BooleanMask m{mask.data(), B, T, S, int64_t(T) * S, S, 1};
  const int64_t words = jfa::mask_words(S), chunks = jfa::mask_chunks(S), row_blocks = jfa::mask_row_blocks(T);
  PackedMaskHost h;
  h.bits.resize(size_t(B * T * words));
  h.tiles.resize(size_t(B * row_blocks * chunks));
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < T; ++i)
      for (int64_t c = 0; c < chunks; ++c)
        for (int w = 0; w < jfa::kMaskChunkWords; ++w)
          h.bits[size_t((int64_t(b) * T + i) * words + c * jfa::kMaskChunkWords + w)] = jfa::pack_mask_word(m, b, i, c, w);
    for (int64_t rb = 0; rb < row_blocks; ++rb)
      for (int64_t c = 0; c < chunks; ++c)
        h.tiles[size_t((b * row_blocks + rb) * chunks + c)] =
            uint8_t(jfa::summarize_mask_tile(h.bits.data() + size_t(b) * T * words, T, S, rb, c));
  }
  return h;
}

inline jfa::PackedMaskView packed_mask_view(const uint32_t* bits, const uint8_t* tiles, int T, int S) {
  jfa::PackedMaskView v;
  v.bits = bits;
  v.tiles = tiles;
  v.words = jfa::mask_words(S);
  v.chunks = jfa::mask_chunks(S);
  v.row_blocks = jfa::mask_row_blocks(T);
  v.bits_batch_stride = T * v.words;
  v.tiles_batch_stride = v.row_blocks * v.chunks;
  return v;
}
