// The Hopper forward's general (masked) path in its key loop, for one consumer thread and tile:
// the policies of mask_policies.h (positions, segment ids, the boolean mask, score modifiers) applied per
// key block. A block runs only the per-element tests its elements need (block_needs); without score
// modifiers a block that needs none skips the policy code altogether, and with ALiBi on the tensor
// cores (the prefix, fwd_mainloop.h) ALiBi is no score modifier: such a block takes its shift alone.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "jfa/params.h"
#include "jfa/score_mod.h"
#include "fwd_params.h"
#include "mask_policies.h"
#include "tile_scheduler.h"

namespace jfa::sm90 {

using namespace cute;

template <typename Traits, int kPolicies, int kRows>
struct FwdGeneralTile {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr bool kAlibiPrefix = alibi_on_tensor_cores(kPolicies);
  static constexpr int kScoreMods = kPolicyAlibi | kPolicyScore;
  // Only ALiBi leaves a per-row shift of a block's scores (apply_policy), which the softmax adds;
  // the other sets' kernels run the softmax without it.
  static constexpr bool kShifts = (kPolicies & kPolicyAlibi) != 0;
  // bf16 holds any slope / scale (float's range); fp16 falls back to the per-element term past its own.
  static constexpr bool kPrefixHoldsAnySlope = !is_same_v<Element, cutlass::half_t>;

  TileRows<kRows> rows;  // this thread's rows (read_rows, under the tile's first GEMM)
  int batch, head, m0;
  bool score_mods;       // score modifiers run on every block
  float prefix_slope;    // ALiBi's slope in raw-score units, for the tensor cores' prefix
  bool alibi_prefix;     // this tile's ALiBi runs on the tensor cores
  bool alibi_in_scores;  // what apply_policy is told of the loop's scores
  // The boolean mask's words of this thread's rows for the block at hand (load_mask_words), where
  // a block's keys lie in one chunk of the packed mask (one word per row).
  static constexpr bool kMaskWords = (kPolicies & kPolicyBoolMask) != 0 && kMaskChunkKeys % kBlockN == 0;
  uint32_t mask_words[kRows];

  __forceinline__ __device__ FwdGeneralTile(const AttentionParams& p, const TileCoord& t, int m0_)
      : batch(t.batch), head(t.head), m0(m0_) {
    // The prefix kernel always has slopes (fwd_launch.h runs it for calls with ALiBi only; without
    // them its prefix and shifts would add zeros): a compile-time true there.
    score_mods = kAlibiPrefix || ((kPolicies & kScoreMods) && p.mask.has_score_mod());
    const MaskParams& m = p.mask;
    prefix_slope = kAlibiPrefix && m.alibi_slopes != nullptr ? m.alibi_slope(t.batch, t.head) * (kLog2eF / p.scale_log2)
                                                              : 0.f;
    alibi_prefix = kAlibiPrefix && (kPrefixHoldsAnySlope || fabsf(prefix_slope) <= 65504.f);
    // A compile-time true where every slope takes the prefix, so that apply_policy's per-element
    // ALiBi path is not compiled into the loop.
    alibi_in_scores = kAlibiPrefix && (kPrefixHoldsAnySlope || alibi_prefix);
  }

  // Read under the tile's first GEMM: read before it, the rows' 64-bit position bounds would sit
  // between the tile meeting and that GEMM's issue.
  template <typename Coords>
  __forceinline__ __device__ void read_rows(const AttentionParams& p, Coords const& coords) {
    rows = tile_rows<kPolicies, kRows, Traits::kBlockM, kBlockN>(p, batch, head, m0, coords);
  }

  // The per-element tests of block n_block: the boolean mask's wherever the tile's summaries do not
  // prove the block full (`mask_partial`, from the producer's walk: FwdBlockWalk).
  __forceinline__ __device__ int needs(const AttentionParams& p, int n_block, bool mask_partial) const {
    int needs = block_needs<kPolicies>(p, rows, n_block);
    if constexpr ((kPolicies & kPolicyBoolMask) != 0)
      if (mask_partial) needs |= kNeedsMask;
    return needs;
  }

  // Block n_block's mask words, loaded while its Q·Kᵀ runs: loaded in the element pass, their
  // latency (the mask is read once per tile, so from HBM or L2) stood between that GEMM and the
  // softmax of every block the mask cuts.
  template <typename Coords>
  __forceinline__ __device__ void load_mask_words(const AttentionParams& p, Coords const& coords, int n_block,
                                                  int block_needs) {
    if constexpr (kMaskWords) {
      if (block_needs & kNeedsMask) {
        const int lane_pair = get<1>(coords(0, 0));  // 2 · quad lane: the thread's first column
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int i = min(m0 + get<0>(coords(r, 0)), int(p.T) - 1);
          mask_words[r] = mask_block_word(p.mask.packed_mask.row(batch, head, i), n_block * kBlockN, lane_pair);
        }
      }
    }
  }

  // Block n_block's scores with its masks and modifiers applied, in the units the softmax multiplies
  // by policy_logit_scale, and its per-row shifts. `alibi_in` whether the scores hold ALiBi's prefix.
  template <typename Scores, typename Coords, typename Coords0>
  __forceinline__ __device__ void scores(Scores& s, Coords const& coords, Coords0 const& coords0, const AttentionParams& p,
                                         int n_block, int block_needs, bool alibi_in, float (&shift)[kRows]) const {
    const int n0 = n_block * kBlockN;
    const uint32_t* words = kMaskWords ? mask_words : nullptr;
    if (score_mods && !alibi_in) {
      apply_policy<kPolicies>(s, coords, coords0, p, rows, batch, head, m0, n0, kBlockN, block_needs, shift, false, words);
    } else if (block_needs != 0) {
      if (alibi_in)
        apply_policy<kPolicies>(s, coords, coords0, p, rows, batch, head, m0, n0, kBlockN, block_needs, shift, true, words);
      else
        apply_policy<kPolicies & ~kScoreMods>(s, coords, coords0, p, rows, batch, head, m0, n0, kBlockN, block_needs,
                                              shift, false, words);
    } else {
      const float uniform = alibi_in && score_mods ? alibi_shift(prefix_slope, rows, n0) : 0.f;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) shift[r] = uniform;
    }
  }

  // The rows' side of the prefix, in registers: (a1, a2, a3, 0, ...) in every row, the slope in
  // three 16-bit pieces. The caller's GEMMs that read the fragment have finished.
  template <typename Frag, typename FragCoords>
  __forceinline__ __device__ void set_prefix_rows(Frag& a, FragCoords const& coords) const {
    const Element a1(prefix_slope);
    const float rest = prefix_slope - float(a1);
    const Element a2(rest);
    const Element a3(rest - float(a2));
    CUTE_UNROLL
    for (int i = 0; i < size(a); ++i) {
      const int k = get<1>(coords(i));
      a(i) = k == 0 ? a1 : k == 1 ? a2 : k == 2 ? a3 : Element(0.f);
    }
  }
};

}  // namespace jfa::sm90
