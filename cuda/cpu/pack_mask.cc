#include "pack_mask.h"

#include "parallel_for.h"

namespace jfa::cpu {

void pack_mask(const BooleanMask& mask, uint32_t* bits, uint8_t* tiles) {
  const int64_t words = mask_words(mask.S), chunks = mask_chunks(mask.S);
  const int64_t row_blocks = mask_row_blocks(mask.T);
  // One item per (slice, 64-row block): it packs the block's rows, then summarizes its tiles while
  // their words are still in cache.
  parallel_for(mask.slices * row_blocks, [&](int, int64_t item) {
    const int64_t slice = item / row_blocks, row_block = item % row_blocks;
    const int64_t r0 = row_block * kMaskTileRows;
    const int64_t r1 = r0 + kMaskTileRows < mask.T ? r0 + kMaskTileRows : mask.T;
    uint32_t* slice_bits = bits + slice * mask.T * words;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < chunks; ++c)
        for (int w = 0; w < kMaskChunkWords; ++w)
          slice_bits[r * words + c * kMaskChunkWords + w] = pack_mask_word(mask, slice, r, c, w);
    uint8_t* tile_row = tiles + item * chunks;
    for (int64_t c = 0; c < chunks; ++c)
      tile_row[c] = static_cast<uint8_t>(summarize_mask_tile(slice_bits, mask.T, mask.S, row_block, c));
  });
}

}  // namespace jfa::cpu
