// The causal mask as the CPU kernels need it: how many keys a query block sees (so whole K/V blocks
// above the diagonal are skipped) and -inf on the entries of the boundary blocks only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "jfa/params.h"

namespace jfa::cpu {

// One past the last key that any of the query rows [i0, i0 + rows) may see.
inline int64_t visible_key_end(const AttentionParams& p, int64_t i0, int rows) {
  return p.is_causal ? std::min<int64_t>(p.S, i0 + rows) : p.S;
}

// First query row that may see any of the keys [j0, ...): causal top-left alignment, i >= j.
inline int64_t first_visible_query(const AttentionParams& p, int64_t j0) { return p.is_causal ? j0 : 0; }

// Sets to -inf the entries of a score tile for queries [i0, i0 + rows) and keys [j0, j0 + cols)
// that are hidden: keys beyond S (padding columns up to the tile width) and, if causal, keys after
// the query. Tile layout s[query][key] (ld = tile width in keys), or s[key][query] if transposed
// (ld = tile width in queries; padding queries are left alone: their lse makes P zero).
inline void mask_scores(const AttentionParams& p, int64_t i0, int rows, int64_t j0, int cols, float* s,
                        int ld, bool transposed) {
  const bool causal_boundary = p.is_causal && j0 + cols - 1 > i0;
  if (!transposed) {
    if (cols == ld && !causal_boundary) return;
    for (int r = 0; r < rows; ++r) {
      // Keys visible to query i0 + r: [j0, j0 + visible).
      int64_t visible = cols;
      if (p.is_causal) visible = std::min<int64_t>(visible, std::max<int64_t>(0, i0 + r - j0 + 1));
      for (int64_t c = visible; c < ld; ++c) s[static_cast<int64_t>(r) * ld + c] = -INFINITY;
    }
  } else {
    if (!causal_boundary) return;  // keys beyond S are rows beyond `cols`, never read
    for (int c = 0; c < cols; ++c) {
      // Queries that see key j0 + c: i >= j0 + c, i.e. tile columns from j0 + c - i0.
      const int64_t first = std::min<int64_t>(rows, std::max<int64_t>(0, j0 + c - i0));
      for (int64_t r = 0; r < first; ++r) s[static_cast<int64_t>(c) * ld + r] = -INFINITY;
    }
  }
}

}  // namespace jfa::cpu
