// Packing a boolean mask into a PackedMask (jfa/packed_mask.h): the per-word and per-tile steps
// that the CPU packer (cpu/pack_mask.cc) and the CUDA packer (packed_mask/pack_mask.cu) share, so
// both write the very same bits and summaries.
#pragma once

#include <cstdint>

#include "jfa/host_device.h"
#include "jfa/packed_mask.h"

namespace jfa {

// A boolean mask [slices, T|1, S|1], one byte per element (nonzero = visible), one slice per
// (batch, head) of the mask; a broadcast row or key axis has stride 0, so it is never expanded.
struct BooleanMask {
  const uint8_t* data = nullptr;
  int64_t slices = 0, T = 0, S = 0;
  int64_t slice_stride = 0, row_stride = 0, key_stride = 0;  // elements

  JFA_HOST_DEVICE bool at(int64_t slice, int64_t i, int64_t j) const {
    return data[slice * slice_stride + i * row_stride + j * key_stride] != 0;
  }
};

// Word `word` of chunk `chunk` of row i of a slice: bit b set iff key 128 chunk + x, x =
// mask_key_of_bit(word, b), is below S and visible.
JFA_HOST_DEVICE uint32_t pack_mask_word(const BooleanMask& m, int64_t slice, int64_t i, int64_t chunk,
                                        int word) {
  uint32_t bits = 0;
  for (int b = 0; b < 32; ++b) {
    const int64_t j = chunk * kMaskChunkKeys + mask_key_of_bit(word, b);
    if (j < m.S && m.at(slice, i, j)) bits |= 1u << b;
  }
  return bits;
}

// Accumulates a summary over the in-range bits of a tile's words.
struct MaskTileSummary {
  bool any = false;
  bool all = true;

  JFA_HOST_DEVICE void add(uint32_t word, uint32_t in_range) {
    word &= in_range;
    any = any || word != 0;
    all = all && word == in_range;
  }
  JFA_HOST_DEVICE MaskTileKind kind() const {
    return !any ? MaskTileKind::kEmpty : all ? MaskTileKind::kFull : MaskTileKind::kPartial;
  }
};

// The summary of tile (row_block, chunk) of one slice's bits [T, mask_words(S)].
JFA_HOST_DEVICE MaskTileKind summarize_mask_tile(const uint32_t* slice_bits, int64_t T, int64_t S,
                                                 int64_t row_block, int64_t chunk) {
  const int64_t words = mask_words(S);
  const int64_t r0 = row_block * kMaskTileRows;
  const int64_t r1 = r0 + kMaskTileRows < T ? r0 + kMaskTileRows : T;
  uint32_t in_range[kMaskChunkWords];
  for (int w = 0; w < kMaskChunkWords; ++w) in_range[w] = mask_bits_below(w, S - chunk * kMaskChunkKeys);
  MaskTileSummary summary;
  for (int64_t r = r0; r < r1; ++r)
    for (int w = 0; w < kMaskChunkWords; ++w)
      summary.add(slice_bits[r * words + chunk * kMaskChunkWords + w], in_range[w]);
  return summary.kind();
}

}  // namespace jfa
