// Masks, score modifiers and dropout as the CPU kernels apply them to float32 score tiles, on top
// of the shared policies in jfa/mask.h, jfa/packed_mask.h, jfa/score_mod.h and jfa/philox.h.
//
// A kernel asks which keys a query block may see (key_range in jfa/mask.h: the trip count of the
// key loop) and, per tile, what kind the tile is and which per-element tests it needs
// (tile_masks); prepare_scores then turns raw logits (log2 units) into final ones: score modifiers
// everywhere, -inf where hidden, and per-element predicates only on partial tiles.
#pragma once

#include <cstdint>

#include "attention_cpu.h"
#include "jfa/mask.h"
#include "jfa/params.h"

namespace jfa::cpu {

// One score tile: query rows [i0, i0 + rows) of head n, keys [j0, j0 + cols), batch b.
struct TileCoords {
  int64_t b, n, i0;
  int rows;
  int64_t j0;
  int cols;
};

// A tile's kind from positions, segment ids and the packed mask together, and which per-element
// tests its partial elements need: the positions and segment ids (jfa/mask.h's visible), the mask's
// bits, or both. A tile is full only when both sides are; each side is tested only where it is
// partial.
struct TileMasks {
  TileKind kind;
  bool test_positions;
  bool test_bits;
};

// The tile's masks (kind kSkip: nothing to compute).
TileMasks tile_masks(const AttentionParams& p, const SequenceBounds& s, const TileCoords& t);

// Turns a tile of raw logits (log2 units) into final ones. Layout s[query][key] (ld in keys;
// columns cols..ld are padding and set to -inf) or, if transposed, s[key][query] (ld in queries;
// padding queries are left alone, their lse makes P zero). softcap_grad, when not null, is a tile
// of the same layout that receives d(final)/d(raw) for visible elements (see score_mod.h).
void prepare_scores(const AttentionParams& p, const SequenceBounds& s, const TileCoords& t,
                    const TileMasks& masks, float* scores, int ld, bool transposed, float* softcap_grad);

// P ← P · keep / (1 - rate) on a probability tile of either layout (see params.h, MaskParams).
void apply_dropout(const AttentionParams& p, const TileCoords& t, float* probs, int ld, bool transposed);

// Elementwise a[k] *= b[k] on the first rows x cols of two tiles of the same layout.
void multiply_tiles(float* a, const float* b, int rows, int cols, int ld);

}  // namespace jfa::cpu
