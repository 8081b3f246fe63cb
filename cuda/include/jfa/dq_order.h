// The orders of the deterministic backward's dQ adds (the protocol: sm80/dq_accum.h), as the
// turn of one key block's add into one query tile: how many key blocks add into it before. Plain
// integer arithmetic shared by the kernels and by tests/cuda/sm80_check.cu, which checks both
// closed forms against brute-force counts.
#pragma once

#include "jfa/host_device.h"

namespace jfa {

// Ordered causal (top-left, block_m x block_n tiles): key blocks n' < ceil((m + 1) block_m /
// block_n) add into query tile m. The key blocks form chunks of `chunk` consecutive blocks (of
// every head at once: the causal grid issues all heads' key block 0, then all heads' block 1, and
// so on). A tile takes the adds of lower chunks first; within a chunk, the higher key blocks first.
JFA_HOST_DEVICE int ordered_causal_turn(int m_block, int n_block, int block_m, int block_n, int num_n_blocks,
                                        int chunk) {
  const int covering = ((m_block + 1) * block_m + block_n - 1) / block_n;
  const int adding = covering < num_n_blocks ? covering : num_n_blocks;  // key blocks [0, adding)
  const int a = n_block / chunk * chunk, b = a + chunk < adding ? a + chunk : adding;
  return a + (b - 1 - n_block);
}

// Ordered plain: key block n's CTA visits tile (s + n) mod L at step s (L = num_steps, the same
// for every key block). Within n's chunk [a, b) of `chunk` key blocks, n' visits that tile at
// step (s + n - n') mod L; those reaching it at an earlier step, or at the same one with a lower
// index, come first; every key block of the lower chunks (a of them) comes before them all.
// With d = n - n' in [n - b + 1, n - a] and x = s + d: count x with x mod L < s, plus x mod L = s
// with d > 0 (same step, lower index). Closed form, so no loop over the chunk at every step.
JFA_HOST_DEVICE int ordered_plain_turn(int s, int n_block, int chunk, int num_n_blocks, int num_steps) {
  const int a = n_block / chunk * chunk, b = a + chunk < num_n_blocks ? a + chunk : num_n_blocks;
  const int L = num_steps;
  const int shift = (chunk + L - 1) / L * L;  // keeps x >= 0 without changing x mod L
  auto below = [&](int x_end) {               // #{x in [0, x_end) : x mod L < s}
    return x_end / L * s + (x_end % L < s ? x_end % L : s);
  };
  const int d_lo = n_block - b + 1, d_hi = n_block - a;
  int count = below(s + d_hi + 1 + shift) - below(s + d_lo + shift);
  if (d_hi >= 1) {  // x = s + d with d > 0 a multiple of L: same step as n, lower key block
    const int d_first = d_lo > 1 ? d_lo : 1;
    count += d_hi / L - (d_first - 1) / L;
  }
  return a + count;
}

}  // namespace jfa
