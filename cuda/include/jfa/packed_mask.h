// The bit-packed boolean mask (jax_flashattn.PackedMask): its layout, and a view of its two arrays
// that any kernel, CPU or GPU, can read.
//
// bits, uint32 [B|1, N|1, T, words(S)]: each query row's keys are cut into chunks of 128; chunk c
// is the 4 words bits[..., t, 4c + w], and key j = 128c + x lives in word w = (x % 8) / 2 at bit
// b = 2 (x / 8) + x % 2, i.e. x = 8 (b / 2) + 2w + b % 2. Word w holds exactly the columns that
// quad lane w of an sm90 wgmma accumulator (and of an mma.sync m16n8 fragment) owns, in the order
// the thread holds them: such a thread reads one word per row per 128 keys and tests bit n for its
// n-th column. Keys past S are 0.
//
// tiles, uint8 [B|1, N|1, row_blocks(T), chunks(S)]: per tile of kMaskTileRows query rows x
// kMaskChunkKeys keys, a MaskTileKind over its in-range elements (rows past T and keys past S do
// not count). A kernel tile of whole 64-row blocks and either whole chunks or part of one chunk
// combines the summaries it covers: all empty → skip, all full → no per-element test.
#pragma once

#include <cstdint>

#include "jfa/host_device.h"

namespace jfa {

inline constexpr int kMaskChunkKeys = 128;   // keys per chunk of 4 words
inline constexpr int kMaskChunkWords = 4;    // words per chunk: one per quad lane
inline constexpr int kMaskTileRows = 64;     // query rows per tile summary (one wgmma atom's M)

// What a tile summary says about its in-range elements.
enum class MaskTileKind : uint8_t { kEmpty = 0, kPartial = 1, kFull = 2 };

// The word (quad lane) and bit of key x of a chunk, and the inverse.
JFA_HOST_DEVICE int mask_word_of_key(int x) { return (x & 7) >> 1; }
JFA_HOST_DEVICE int mask_bit_of_key(int x) { return ((x >> 3) << 1) | (x & 1); }
JFA_HOST_DEVICE int mask_key_of_bit(int word, int bit) { return ((bit >> 1) << 3) | (word << 1) | (bit & 1); }

JFA_HOST_DEVICE int64_t mask_chunks(int64_t S) { return (S + kMaskChunkKeys - 1) / kMaskChunkKeys; }
JFA_HOST_DEVICE int64_t mask_words(int64_t S) { return mask_chunks(S) * kMaskChunkWords; }
JFA_HOST_DEVICE int64_t mask_row_blocks(int64_t T) { return (T + kMaskTileRows - 1) / kMaskTileRows; }

// The bits of word `word` whose keys x of the chunk lie in [0, keys) (keys may exceed 128).
JFA_HOST_DEVICE uint32_t mask_bits_below(int word, int64_t keys) {
  uint32_t bits = 0;
  for (int b = 0; b < 32; ++b)
    if (mask_key_of_bit(word, b) < keys) bits |= 1u << b;
  return bits;
}

// The bits of word `word` whose keys x of the chunk lie in [lo, hi).
JFA_HOST_DEVICE uint32_t mask_bits_between(int word, int64_t lo, int64_t hi) {
  return mask_bits_below(word, hi) & ~mask_bits_below(word, lo);
}

// Whether key j (any key of the row, not only of one chunk) is set in a row's words.
// Shifts and masks only (j >= 0): the GPU kernels' per-element test.
JFA_HOST_DEVICE bool mask_row_has_key(const uint32_t* row, int64_t j) {
  static_assert(kMaskChunkKeys == 128 && kMaskChunkWords == 4, "the shifts below spell out this layout");
  return (row[((j >> 7) << 2) | ((j >> 1) & 3)] >> (((j >> 2) & 30) | (j & 1))) & 1u;
}

// The tile summaries of one kernel tile's query rows (their row blocks inside T), for a key loop
// that asks about every key block: the (batch, head, row block) offset is taken once per tile, and
// each block's question is a byte or two at 32-bit offsets (the 64-bit index arithmetic per block
// roughly doubled the instructions of the Hopper forward's boolean-mask kernel).
struct MaskRowSummaries {
  const uint8_t* first = nullptr;  // the first row block's summaries, one byte per chunk of keys
  int chunks = 0;                  // summaries per row block: the stride between row blocks
  int row_blocks = 0;              // row blocks of the tile inside T (0: none)

  // Keys [j0, j0 + cols) over the tile's rows: PackedMaskView::block_kind's answer. kMaxRowBlocks
  // bounds row_blocks (the tile's rows / kMaskTileRows, rounded up) so that the loop unrolls.
  template <int kMaxRowBlocks>
  JFA_HOST_DEVICE MaskTileKind block_kind(int j0, int cols) const {
    const int c0 = j0 / kMaskChunkKeys, c_last = (j0 + cols - 1) / kMaskChunkKeys;
    const int c1 = c_last < chunks - 1 ? c_last : chunks - 1;
    bool any = false, all = true;
    for (int rb = 0; rb < kMaxRowBlocks; ++rb) {
      if (rb >= row_blocks) break;
      for (int c = c0; c <= c1; ++c) {
        const auto kind = static_cast<MaskTileKind>(first[rb * chunks + c]);
        any = any || kind != MaskTileKind::kEmpty;
        all = all && kind == MaskTileKind::kFull;
      }
    }
    if (row_blocks <= 0 || c0 > c1) return MaskTileKind::kFull;
    return !any ? MaskTileKind::kEmpty : all ? MaskTileKind::kFull : MaskTileKind::kPartial;
  }
};

// The two arrays of a PackedMask, broadcast to [B, N, ...] by strides (0 on a size-1 axis).
struct PackedMaskView {
  const uint32_t* bits = nullptr;
  const uint8_t* tiles = nullptr;
  int64_t words = 0;        // words per row, mask_words(S)
  int64_t chunks = 0;       // tile summaries per row block, mask_chunks(S)
  int64_t row_blocks = 0;   // mask_row_blocks(T)
  int64_t bits_batch_stride = 0, bits_head_stride = 0;    // elements
  int64_t tiles_batch_stride = 0, tiles_head_stride = 0;  // elements
  // The same bits by key (the Hopper backward's, whose score tiles hold keys in rows): row j holds
  // key j's bits over the queries in the layout above with queries for keys (query x of a chunk of
  // 128 at bit 2·(x / 8) + x % 2 of word (x % 8) / 2), mask_words(T) words per row, rows up to S
  // rounded up to 128 (zero past S). Made per backward call by transpose_mask_bits; null elsewhere.
  const uint32_t* key_bits = nullptr;
  int64_t key_words = 0, key_rows = 0;
  int64_t key_bits_batch_stride = 0, key_bits_head_stride = 0;  // elements; 0 on a broadcast axis

  JFA_HOST_DEVICE bool present() const { return bits != nullptr; }
  // The words of key row j of (batch b, head n) in key_bits.
  JFA_HOST_DEVICE const uint32_t* key_row(int64_t b, int64_t n, int64_t j) const {
    return key_bits + b * key_bits_batch_stride + n * key_bits_head_stride + j * key_words;
  }
  // The words of query row i of (batch b, head n).
  JFA_HOST_DEVICE const uint32_t* row(int64_t b, int64_t n, int64_t i) const {
    return bits + b * bits_batch_stride + n * bits_head_stride + i * words;
  }
  JFA_HOST_DEVICE MaskTileKind tile(int64_t b, int64_t n, int64_t row_block, int64_t chunk) const {
    return static_cast<MaskTileKind>(tiles[b * tiles_batch_stride + n * tiles_head_stride +
                                           row_block * chunks + chunk]);
  }

  // The summaries of the tiles that rows [i0, i0 + rows) x keys [j0, j0 + cols) touch, combined:
  // kEmpty or kFull where every one is, else kPartial. Rows and keys past T and S do not count
  // (the kernels' position bounds hide them); with none left, kFull: the mask hides nothing there.
  JFA_HOST_DEVICE MaskTileKind block_kind(int64_t b, int64_t n, int64_t i0, int64_t rows, int64_t j0,
                                          int64_t cols) const {
    const int64_t rb0 = i0 / kMaskTileRows, c0 = j0 / kMaskChunkKeys;
    const int64_t rb_last = (i0 + rows - 1) / kMaskTileRows, c_last = (j0 + cols - 1) / kMaskChunkKeys;
    const int64_t rb1 = rb_last < row_blocks - 1 ? rb_last : row_blocks - 1;
    const int64_t c1 = c_last < chunks - 1 ? c_last : chunks - 1;
    bool any = false, all = true;
    for (int64_t rb = rb0; rb <= rb1; ++rb)
      for (int64_t c = c0; c <= c1; ++c) {
        const MaskTileKind kind = tile(b, n, rb, c);
        any = any || kind != MaskTileKind::kEmpty;
        all = all && kind == MaskTileKind::kFull;
      }
    if (rb0 > rb1 || c0 > c1) return MaskTileKind::kFull;
    return !any ? MaskTileKind::kEmpty : all ? MaskTileKind::kFull : MaskTileKind::kPartial;
  }

  // The summaries of rows [i0, i0 + rows) of (b, n) (MaskRowSummaries); absent mask: none.
  JFA_HOST_DEVICE MaskRowSummaries row_summaries(int64_t b, int64_t n, int64_t i0, int64_t rows) const {
    MaskRowSummaries s;
    if (!present()) return s;
    const int64_t rb0 = i0 / kMaskTileRows, rb_last = (i0 + rows - 1) / kMaskTileRows;
    const int64_t rb1 = rb_last < row_blocks - 1 ? rb_last : row_blocks - 1;
    s.first = tiles + b * tiles_batch_stride + n * tiles_head_stride + rb0 * chunks;
    s.chunks = static_cast<int>(chunks);
    s.row_blocks = rb1 >= rb0 ? static_cast<int>(rb1 - rb0 + 1) : 0;
    return s;
  }

  // Whether chunk c holds a visible key of some row of row blocks [rb0, rb1] (clamped to T).
  JFA_HOST_DEVICE bool chunk_seen(int64_t b, int64_t n, int64_t rb0, int64_t rb1, int64_t c) const {
    for (int64_t rb = rb0; rb <= rb1 && rb < row_blocks; ++rb)
      if (tile(b, n, rb, c) != MaskTileKind::kEmpty) return true;
    return false;
  }

  // Whether row block rb has a visible key in chunks [c0, c1] (clamped to S).
  JFA_HOST_DEVICE bool row_block_sees(int64_t b, int64_t n, int64_t rb, int64_t c0, int64_t c1) const {
    for (int64_t c = c0; c <= c1 && c < chunks; ++c)
      if (tile(b, n, rb, c) != MaskTileKind::kEmpty) return true;
    return false;
  }
};

}  // namespace jfa
