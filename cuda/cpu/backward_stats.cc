// Pass 0 of the CPU backward: the per-row statistics every later pass reads.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backward_stats.h"
#include "parallel_for.h"
#include "tiles.h"

namespace jfa::cpu {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

float at(const float* x, const Strides& st, int64_t b, int64_t t, int64_t n) {
  return x[b * st.batch + t * st.row + n * st.head];
}

}  // namespace

RowStats row_stats(const AttentionParams& p) {
  RowStats stats{std::vector<float>(p.B * p.N * p.T), std::vector<float>(p.B * p.N * p.T), p.T};
  const int Hv = static_cast<int>(p.Hv);
  const int64_t q_blocks = (p.T + kBr - 1) / kBr;
  std::vector<std::vector<float>> scratch(num_threads_for(p.B * p.N * q_blocks),
                                          std::vector<float>(2 * static_cast<size_t>(kBr) * Hv));
  parallel_for(p.B * p.N * q_blocks, [&](int thread, int64_t item) {
    const int64_t qb = item % q_blocks, b = item / q_blocks / p.N, n = item / q_blocks % p.N;
    const int64_t i0 = qb * kBr;
    const int rows = static_cast<int>(std::min<int64_t>(kBr, p.T - i0));
    float* o = scratch[thread].data();
    float* dout = o + static_cast<size_t>(kBr) * Hv;
    load_rows(head_view(p.o, p.dtype, p.o_strides, b, n), i0, rows, Hv, 1.f, o, Hv, rows);
    load_rows(head_view(p.dout, p.dtype, p.do_strides, b, n), i0, rows, Hv, 1.f, dout, Hv, rows);
    for (int r = 0; r < rows; ++r) {
      float dot = 0.f;
      for (int c = 0; c < Hv; ++c) dot += o[r * Hv + c] * dout[r * Hv + c];
      const int64_t i = i0 + r, packed = (b * p.N + n) * p.T + i;
      const float lse = at(p.lse, p.lse_strides, b, i, n);
      stats.d[packed] = dot - (p.dlse ? at(p.dlse, p.lse_strides, b, i, n) : 0.f);
      stats.lse2[packed] = lse == -INFINITY ? INFINITY : lse * kLog2e;
    }
  });
  return stats;
}

// Copies the stats of query rows [i0, i0 + rows) into kBr-long tiles; padding rows get lse2 = +inf
// (P = 0) and D = 0, so they contribute nothing.
void load_stats(const RowStats& stats, int64_t b, int64_t n, int64_t N, int64_t i0, int rows, float* lse2,
                float* d) {
  std::copy_n(stats.lse2_at(b, n, N, i0), rows, lse2);
  std::copy_n(stats.d_at(b, n, N, i0), rows, d);
  std::fill(lse2 + rows, lse2 + kBr, INFINITY);
  std::fill(d + rows, d + kBr, 0.f);
}


}  // namespace jfa::cpu
