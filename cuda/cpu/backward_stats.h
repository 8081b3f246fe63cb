// What every pass of the CPU backward shares: tile sizes and the per-row softmax statistics of the
// forward pass (pass 0), which let a pass recompute P and dS for any tile on its own.
#pragma once

#include <cstdint>
#include <vector>

#include "attention_cpu.h"
#include "jfa/packed_mask.h"
#include "jfa/params.h"

namespace jfa::cpu {

constexpr int kBr = 64;  // query rows per tile
constexpr int kBc = 64;  // keys per tile (a multiple of 8: dropout draws eight keys per Philox call)
static_assert(kMaskChunkKeys % kBc == 0, "a key tile must lie inside one chunk of the packed mask");

// Per-row softmax statistics of the forward pass, packed [B][N][T] so tiles read them contiguously.
struct RowStats {
  std::vector<float> lse2;  // lse·log2(e); +inf for rows that saw no key, so their P is exactly 0
  std::vector<float> d;     // rowsum(dO∘O) - dLSE
  int64_t T;
  const float* lse2_at(int64_t b, int64_t n, int64_t N, int64_t i) const { return lse2.data() + ((b * N + n) * T + i); }
  const float* d_at(int64_t b, int64_t n, int64_t N, int64_t i) const { return d.data() + ((b * N + n) * T + i); }
};

// Pass 0: the statistics of every row, from o, dout, lse and dlse.
RowStats row_stats(const AttentionParams& p);

// Copies the stats of query rows [i0, i0 + rows) into kBr-long tiles; padding rows get lse2 = +inf
// (P = 0) and D = 0, so they contribute nothing.
void load_stats(const RowStats& stats, int64_t b, int64_t n, int64_t N, int64_t i0, int rows, float* lse2,
                float* d);

// Pass 3 (only with a bias): d(bias) in the bias's broadcast shape (see bias_grad.cc).
void bias_gradient(const AttentionParams& p, const RowStats& stats);

}  // namespace jfa::cpu
