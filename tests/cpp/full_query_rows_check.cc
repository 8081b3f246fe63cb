// jfa::full_query_rows against jfa::position_tile_kind: for every key block and every query block
// of many random position settings (causal with either alignment, windows on either side, valid
// lengths, position offsets), the rows' range must call a tile full exactly when the tile kind
// does. Prints the number of tiles compared; exits 1 on the first disagreement.
#include <cstdint>
#include <cstdio>
#include <random>

#include "jfa/mask.h"

int main() {
  std::mt19937 rng(20261129);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int64_t compared = 0, full = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    jfa::AttentionParams p;
    p.T = pick(1, 300);
    p.S = pick(1, 300);
    p.is_causal = pick(0, 1);
    p.mask.bottom_right = pick(0, 1);
    p.mask.window_left = pick(0, 2) == 0 ? -1 : pick(0, 200);
    p.mask.window_right = pick(0, 2) == 0 ? -1 : pick(0, 200);
    int32_t q_len = int32_t(pick(0, int(p.T))), kv_len = int32_t(pick(0, int(p.S)));
    int32_t positions[2] = {pick(0, 3) == 0 ? pick(0, 500) : 0, pick(0, 3) == 0 ? pick(0, 500) : 0};
    if (pick(0, 1)) {
      p.mask.q_lengths = &q_len;
      p.mask.kv_lengths = &kv_len;
    }
    if (pick(0, 1)) p.mask.positions = positions;
    const jfa::SequenceBounds s = jfa::sequence_bounds(p, 0);
    const int rows_options[] = {1, 16, 64, 80, 128}, cols_options[] = {1, 64, 80, 128};
    const int rows = rows_options[pick(0, 4)], cols = cols_options[pick(0, 3)];
    for (int64_t j0 = 0; j0 < p.S; j0 += cols) {
      const jfa::KeyRange r = jfa::full_query_rows(p, s, j0, cols);
      for (int64_t i0 = 0; i0 < p.T; i0 += rows) {
        const bool by_kind = jfa::position_tile_kind(p, s, i0, rows, j0, cols) == jfa::TileKind::kFull;
        const bool by_rows = r.begin <= i0 && i0 + rows <= r.end;
        ++compared;
        full += by_kind;
        if (by_kind != by_rows) {
          std::printf("mismatch: T=%lld S=%lld causal=%d bottom_right=%d window=(%lld, %lld) q_len=%lld kv_len=%lld "
                      "offset=%lld rows=%d cols=%d i0=%lld j0=%lld: tile kind full=%d, rows [%lld, %lld)\n",
                      (long long)p.T, (long long)p.S, int(p.is_causal), int(p.mask.bottom_right),
                      (long long)p.mask.window_left, (long long)p.mask.window_right, (long long)s.q_len,
                      (long long)s.kv_len, (long long)s.offset, rows, cols, (long long)i0, (long long)j0,
                      int(by_kind), (long long)r.begin, (long long)r.end);
          return 1;
        }
      }
    }
  }
  std::printf("compared %lld tiles, %lld full\n", (long long)compared, (long long)full);
  return full > 0 && full < compared ? 0 : 1;
}
