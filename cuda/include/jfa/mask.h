// Masks as policies, shared by the CPU and (later) the CUDA kernels.
//
// Two levels, as in CUTLASS's and FlashAttention's mask policies:
//   * per tile: the key range a block of query rows may see (the trip count of the key loop) and
//     a classification of each (query block, key block) tile as skip / full / partial, so whole
//     tiles outside the causal triangle, the window band, the valid lengths or the segments are
//     never computed, and full tiles skip the per-element work;
//   * per element, on partial tiles only: visible(b, n, i, j).
// Score modifiers (softcap, bias, ALiBi) apply to every computed tile; see score_mod.h.
#pragma once

#include <cstdint>

#include "jfa/host_device.h"
#include "jfa/params.h"

namespace jfa {

// Per batch element: valid lengths and the offset that aligns query positions with key positions.
struct SequenceBounds {
  int64_t q_len;
  int64_t kv_len;
  int64_t offset;  // query i sits at key position i + offset
};

JFA_HOST_DEVICE int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }
JFA_HOST_DEVICE int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

JFA_HOST_DEVICE int64_t clamp_length(const int32_t* lengths, int64_t b, int64_t full) {
  if (lengths == nullptr) return full;
  const int64_t n = lengths[b];
  return n < 0 ? 0 : (n > full ? full : n);
}

JFA_HOST_DEVICE SequenceBounds sequence_bounds(const AttentionParams& p, int64_t b) {
  SequenceBounds s;
  s.q_len = clamp_length(p.mask.q_lengths, b, p.T);
  s.kv_len = clamp_length(p.mask.kv_lengths, b, p.S);
  s.offset = (p.mask.bottom_right ? s.kv_len - s.q_len : 0) + p.mask.query_position0(b) - p.mask.key_position0(b);
  return s;
}

// Keys [key_lo, key_hi) that query row i may see by position (causal, window, kv length); the
// bounds are non-decreasing in i, so a block's range is [key_lo(first row), key_hi(last row)).
JFA_HOST_DEVICE int64_t key_lo(const AttentionParams& p, const SequenceBounds& s, int64_t i) {
  int64_t lo = 0;
  if (p.mask.window_left >= 0) {
    const int64_t w = i + s.offset - p.mask.window_left;
    lo = w > lo ? w : lo;
  }
  return lo;
}

JFA_HOST_DEVICE int64_t key_hi(const AttentionParams& p, const SequenceBounds& s, int64_t i) {
  int64_t hi = s.kv_len;
  if (p.is_causal) {
    const int64_t c = i + s.offset + 1;
    hi = c < hi ? c : hi;
  }
  if (p.mask.window_right >= 0) {
    const int64_t w = i + s.offset + p.mask.window_right + 1;
    hi = w < hi ? w : hi;
  }
  return hi;
}

// Keys [begin, end) that any query of rows [i0, i0 + rows) may see by position; empty if no row
// is valid.
struct KeyRange {
  int64_t begin;
  int64_t end;
};

JFA_HOST_DEVICE KeyRange key_range(const AttentionParams& p, const SequenceBounds& s, int64_t i0,
                                   int64_t rows) {
  const int64_t last = (i0 + rows < s.q_len ? i0 + rows : s.q_len) - 1;
  if (last < i0) return KeyRange{0, 0};
  const int64_t lo = key_lo(p, s, i0), hi = key_hi(p, s, last);
  return KeyRange{lo, hi > lo ? hi : lo};
}

// Query rows [begin, end) that may see some key of [j0, j0 + cols) by position: the transpose of
// key_range, for kernels that loop over query blocks per key block (the GPU backward). Follows from
// key_lo / key_hi being non-decreasing in i: row i sees the block iff key_lo(i) < min(j0 + cols,
// kv_len) and key_hi(i) > j0.
JFA_HOST_DEVICE KeyRange query_range(const AttentionParams& p, const SequenceBounds& s, int64_t j0,
                                     int64_t cols) {
  const int64_t j1 = j0 + cols < s.kv_len ? j0 + cols : s.kv_len;
  if (j1 <= j0) return KeyRange{0, 0};
  int64_t lo = 0, hi = s.q_len;
  if (p.is_causal) lo = j0 - s.offset > lo ? j0 - s.offset : lo;  // i + offset + 1 > j0
  if (p.mask.window_right >= 0) {
    const int64_t w = j0 - s.offset - p.mask.window_right;  // i + offset + right + 1 > j0
    lo = w > lo ? w : lo;
  }
  if (p.mask.window_left >= 0) {
    const int64_t w = j1 - s.offset + p.mask.window_left;  // i + offset - left < j1
    hi = w < hi ? w : hi;
  }
  return KeyRange{lo, hi > lo ? hi : lo};
}

// The first x in [lo, hi] with seen(x), else hi + 1, and the last x in [lo, hi] with seen(x),
// else lo - 1. kWarp (GPU code whose calling warp has all 32 lanes here): the lanes test 32 values
// at once and a ballot picks the first that answered, so a long run of empty summaries costs one
// read per 32 instead of one dependent read each (a causal mask given as a tensor scans from the
// far end to its diagonal). Host code (nvcc's host pass, the CPU kernels) always takes the serial
// loop.
template <bool kWarp>
inline constexpr bool kMaskScanBallot =
#ifdef __CUDA_ARCH__
    kWarp;
#else
    false;
#endif

template <bool kWarp, typename Seen>
JFA_HOST_DEVICE int first_seen(int lo, int hi, Seen&& seen) {
  if constexpr (kMaskScanBallot<kWarp>) {
#ifdef __CUDA_ARCH__
    const int lane = int(threadIdx.x % 32);
    for (int base = lo; base <= hi; base += 32) {
      const unsigned hits = __ballot_sync(0xffffffffu, base + lane <= hi && seen(base + lane));
      if (hits != 0) return base + __ffs(hits) - 1;
    }
#endif
    return hi + 1;
  } else {
    while (lo <= hi && !seen(lo)) ++lo;
    return lo;
  }
}

template <bool kWarp, typename Seen>
JFA_HOST_DEVICE int last_seen(int lo, int hi, Seen&& seen) {
  if constexpr (kMaskScanBallot<kWarp>) {
#ifdef __CUDA_ARCH__
    const int lane = int(threadIdx.x % 32);
    for (int top = hi; top >= lo; top -= 32) {
      const unsigned hits = __ballot_sync(0xffffffffu, top - lane >= lo && seen(top - lane));
      if (hits != 0) return top - (__ffs(hits) - 1);
    }
#endif
    return lo - 1;
  } else {
    while (hi >= lo && !seen(hi)) --hi;
    return hi;
  }
}

// Keys r of rows [i0, i0 + rows) of head n narrowed by the bit-packed mask's tile summaries: from
// the first to the last chunk of 128 keys in which some of those rows see a key (empty if none).
// Both ends are found by scans that stop at the first such chunk (first_seen, last_seen).
template <bool kWarp = false>
JFA_HOST_DEVICE KeyRange mask_narrowed_keys(const AttentionParams& p, int64_t b, int64_t n, int64_t i0,
                                            int64_t rows, KeyRange r) {
  const PackedMaskView& m = p.mask.packed_mask;
  if (!m.present() || r.end <= r.begin) return r;
  const int rb0 = int(i0 / kMaskTileRows), rb1 = int(min_i64((i0 + rows - 1) / kMaskTileRows, m.row_blocks - 1));
  const int chunks = int(m.chunks);
  const uint8_t* tiles = m.tiles + b * m.tiles_batch_stride + n * m.tiles_head_stride;
  auto seen = [&](int c) {
    for (int rb = rb0; rb <= rb1; ++rb)
      if (tiles[rb * chunks + c] != uint8_t(MaskTileKind::kEmpty)) return true;
    return false;
  };
  const int lo = int(r.begin / kMaskChunkKeys), hi = int((r.end - 1) / kMaskChunkKeys);
  const int first = first_seen<kWarp>(lo, hi, seen);
  if (first > hi) return KeyRange{r.begin, r.begin};
  const int last = last_seen<kWarp>(first + 1, hi, seen);  // first if none
  const int64_t begin = max_i64(r.begin, int64_t(first) * kMaskChunkKeys);
  return KeyRange{begin, max_i64(min_i64(r.end, int64_t(last + 1) * kMaskChunkKeys), begin)};
}

// Queries r that see keys [j0, j0 + cols) narrowed likewise, over heads [n0, n0 + heads) (a GQA
// group that one key block's walk serves): from the first to the last row block of 64 queries
// in which some head's rows see a key of those chunks.
template <bool kWarp = false>
JFA_HOST_DEVICE KeyRange mask_narrowed_queries(const AttentionParams& p, int64_t b, int64_t n0, int64_t heads,
                                               int64_t j0, int64_t cols, KeyRange r) {
  const PackedMaskView& m = p.mask.packed_mask;
  if (!m.present() || r.end <= r.begin) return r;
  const int c0 = int(j0 / kMaskChunkKeys), c1 = int(min_i64((j0 + cols - 1) / kMaskChunkKeys, m.chunks - 1));
  const int chunks = int(m.chunks);
  // A mask shared by the heads (stride 0) is scanned once.
  const int distinct = m.tiles_head_stride == 0 ? 1 : int(heads);
  const uint8_t* tiles = m.tiles + b * m.tiles_batch_stride + n0 * m.tiles_head_stride;
  auto seen = [&](int rb) {
    for (int h = 0; h < distinct; ++h)
      for (int c = c0; c <= c1; ++c)
        if (tiles[h * m.tiles_head_stride + rb * chunks + c] != uint8_t(MaskTileKind::kEmpty)) return true;
    return false;
  };
  const int lo = int(r.begin / kMaskTileRows), hi = int((r.end - 1) / kMaskTileRows);
  const int first = first_seen<kWarp>(lo, hi, seen);
  if (first > hi) return KeyRange{r.begin, r.begin};
  const int last = last_seen<kWarp>(first + 1, hi, seen);  // first if none
  const int64_t begin = max_i64(r.begin, int64_t(first) * kMaskTileRows);
  return KeyRange{begin, max_i64(min_i64(r.end, int64_t(last + 1) * kMaskTileRows), begin)};
}

// Query rows whose tiles against keys [j0, j0 + cols) position_tile_kind calls full: a tile of
// rows [i0, i0 + rows) (rows, cols >= 1, i0 >= 0) is kFull exactly when begin <= i0 and
// i0 + rows <= end. It is position_tile_kind's test solved for i0, which key_lo / key_hi being
// non-decreasing in i allows: kernels that walk the query blocks of one key block (the GPU
// backward) compute it once rather than the tile kind per block.
JFA_HOST_DEVICE KeyRange full_query_rows(const AttentionParams& p, const SequenceBounds& s, int64_t j0,
                                         int64_t cols) {
  const int64_t j1 = j0 + cols;
  if (j1 > s.kv_len) return KeyRange{0, 0};
  int64_t begin = 0, end = s.q_len;  // rows past the valid length are never full
  // key_hi(i0) >= j1 for the first row: causal i0 + offset + 1 >= j1, right window
  // i0 + offset + right + 1 >= j1 (later rows see at least as far).
  if (p.is_causal) begin = max_i64(begin, j1 - s.offset - 1);
  if (p.mask.window_right >= 0) begin = max_i64(begin, j1 - s.offset - p.mask.window_right - 1);
  // key_lo(last) <= j0 for the last row: last + offset - left <= j0.
  if (p.mask.window_left >= 0) end = min_i64(end, j0 - s.offset + p.mask.window_left + 1);
  return end > begin ? KeyRange{begin, end} : KeyRange{0, 0};
}

enum class TileKind { kSkip, kFull, kPartial };

// Classifies tile rows [i0, i0 + rows) x keys [j0, j0 + cols) by position. Segment ids and the
// boolean mask are data; callers refine kFull/kPartial with them (segment_tile_kind below).
JFA_HOST_DEVICE TileKind position_tile_kind(const AttentionParams& p, const SequenceBounds& s,
                                            int64_t i0, int64_t rows, int64_t j0, int64_t cols) {
  const KeyRange r = key_range(p, s, i0, rows);
  // An empty range may lie inside the tile (a window's left edge past the key length).
  if (r.end <= r.begin || r.end <= j0 || r.begin >= j0 + cols) return TileKind::kSkip;
  const int64_t last = i0 + rows - 1;
  const bool full = last < s.q_len && j0 + cols <= s.kv_len && key_lo(p, s, last) <= j0 &&
                    key_hi(p, s, i0) >= j0 + cols;
  return full ? TileKind::kFull : TileKind::kPartial;
}

// Refines a tile's kind with segment ids, given the min/max id of its valid queries and keys:
// disjoint ranges share no id (skip); one id on both sides keeps the tile full.
JFA_HOST_DEVICE TileKind segment_tile_kind(TileKind kind, int32_t q_min, int32_t q_max,
                                           int32_t k_min, int32_t k_max) {
  if (kind == TileKind::kSkip || q_max < k_min || k_max < q_min) return TileKind::kSkip;
  if (kind == TileKind::kFull && !(q_min == q_max && k_min == k_max && q_min == k_min))
    return TileKind::kPartial;
  return kind;
}

// Whether query i (head n) of batch b sees key j: the per-element predicate of partial tiles.
JFA_HOST_DEVICE bool visible(const AttentionParams& p, const SequenceBounds& s, int64_t b,
                             int64_t n, int64_t i, int64_t j) {
  if (i >= s.q_len || j < key_lo(p, s, i) || j >= key_hi(p, s, i)) return false;
  const MaskParams& m = p.mask;
  if (m.q_segment_ids != nullptr &&
      m.q_segment_ids[b * p.T + i] != m.kv_segment_ids[b * p.S + j])
    return false;
  if (m.packed_mask.present() && !mask_row_has_key(m.packed_mask.row(b, n, i), j)) return false;
  return true;
}

}  // namespace jfa
