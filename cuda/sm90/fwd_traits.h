// Tile shapes, thread roles, smem layouts and wgmma atoms of the Hopper (sm90a) forward kernel.
//
// A CTA is one producer warpgroup (TMA loads, registers lowered with setmaxnreg) and kBlockM / 64
// consumer warpgroups (each owns 64 query rows: wgmma's M is 64 per warpgroup). Tile table
// (kBlockM x kBlockN, consumer warpgroups, K/V stages), FA3's H100 choices checked against the
// register and smem budgets (228 KB smem per SM, 64K registers per SM, one CTA per SM):
//   hdim  64: 192 x 128, 3 WGs, 2 stages  Q·Kᵀ is cheap per key (k = 64), so the softmax (exp2 on
//             the MUFU) dominates; three consumer warpgroups keep the tensor cores fed while two
//             others run softmax. 160 regs per consumer thread: S (64 f32) + O (32 f32) + P fit.
//             smem Q 24 + K/V 2 x 2 x 16 + O 24 = 112 KB.
//   hdim 128: 128 x 176 (non-causal) / 128 x 128 (causal), 2 WGs, 2 stages  FA3's choice: S 88 +
//             O 64 + P 44 f32 per thread in 240 registers; smem Q 32 + K/V 2 x 2 x 44 = 208 KB,
//             so O reuses Q's smem (causal: Q 32 + K/V 2 x 2 x 32 + O 32 = 192 KB).
//   hdim 256: 128 x  80, 2 WGs, 2 stages  O alone is 128 f32 per thread, so S shrinks to 40;
//             kBlockN = 80 (a valid wgmma N and a multiple of 16 for P·V's k) is what fits:
//             Q 64 + K/V 2 x 2 x 40 = 224 KB, so O reuses Q's smem in the epilogue.
// Short sequences take 128 x 128 with 2 WGs instead where that is faster (fwd_launch.h).
// Registers: setmaxnreg moves registers between warpgroups of a CTA; consumers can only gain what
// the producer gives back from the launch allocation (65536 / threads, rounded down to 8: 168 for
// 384 threads, 128 for 512). 2 consumers: producer 24, consumers 240 (128·24 + 256·240 = 168·384);
// 3 consumers: producer 32, consumers 160 (128·32 + 384·160 = 128·512). Asking for more blocks the
// consumers' setmaxnreg forever (a hang, not an error), hence the static_assert below.
// docs/performance.md ("Hopper forward") has the measurements behind the tile choices.
#pragma once

#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "tile_scheduler.h"
#include "tma.h"
#include "utils.h"

namespace jfa::sm90 {

using namespace cute;

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct FwdTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static_assert(kBlockM % 64 == 0 && kHeadDim % 64 == 0 && kBlockN % 16 == 0);

  static constexpr int kNumMmaWarpGroups = kBlockM / 64;
  static_assert(kNumMmaWarpGroups == 2 || kNumMmaWarpGroups == 3, "ping-pong needs 2 or 3 consumers");
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * 128;
  static constexpr int kNumThreads = kNumMmaThreads + 128;  // + the producer warpgroup
  static constexpr int kLoadRegs = kNumMmaWarpGroups == 2 ? 24 : 32;
  static constexpr int kMmaRegs = kNumMmaWarpGroups == 2 ? 240 : 160;
  static constexpr int kLaunchRegs = 65536 / kNumThreads / 8 * 8;
  static_assert(kLoadRegs * 128 + kMmaRegs * kNumMmaThreads <= kLaunchRegs * kNumThreads,
                "setmaxnreg budget exceeds the registers the CTA is launched with");

  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // (M, N, K) of S = Q·Kᵀ
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;  // (M, N, K) of O = P·V
  using AtomLayout = Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>;     // warpgroups split M
  // Q·Kᵀ: both operands from smem, K-major. P·V: P from registers, V read as MN-major (its head
  // dim is contiguous), which wgmma supports for 16-bit types through the transpose bit.
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, TileShapeQK>(), AtomLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, TileShapePV, GMMA::Major::K,
                           GMMA::Major::MN>(), AtomLayout{}));

  // Q, K, V and O all use the 128-byte swizzled K-major atom (tma.h).
  using SmemAtom = SmemAtomSw128<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutV = SmemLayoutK;
  // V viewed as (H, kBlockN, stages): the B operand of P·V (N = H, K = keys).
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                         Step<_2, _1, _3>{})));
  // O has Q's layout, so when it reuses Q's smem each warpgroup writes only its own rows, which
  // it stores in boxes of 64 rows x 64 columns (tma.h, tma_store_rows).
  using SmemLayoutO = SmemLayoutQ;
  // ALiBi's k prefix of Q·Kᵀ (fwd_mainloop.h, kAlibiPrefix): one wgmma k block of 16 per row and key.
  // The rows' side comes from registers (every row of a tile holds the same values), so that block
  // is an RS wgmma; the keys' side is in smem, in the 32-byte swizzled K-major atom (8 rows x 16
  // elements).
  static constexpr int kPrefixK = 16;
  using TiledMmaQKPrefix = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockM>, Int<kBlockN>, Int<kPrefixK>>,
                           GMMA::Major::K, GMMA::Major::K>(), AtomLayout{}));
  using SmemAtomPrefix = GMMA::Layout_K_SW32_Atom<Element>;
  using SmemLayoutKPrefix = decltype(tile_to_shape(SmemAtomPrefix{}, Shape<Int<kBlockN>, Int<kPrefixK>>{}));

  static constexpr int kQBytes = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kKVStageBytes = kBlockN * kHeadDim * int(sizeof(Element));
  // O gets its own buffer where smem allows (the next tile's Q can then load during the epilogue).
  static constexpr bool kOAliasesQ = 2 * kQBytes + 2 * kStages * kKVStageBytes > 220 * 1024;
  // Rescale O only on blocks that raise a row's running max (softmax.h, kMaxGrowthLog2), with a
  // warp vote and a branch around the FMULs; the 128 x 176 tile gains nothing from it and keeps
  // rescaling on every block.
  static constexpr bool kRescaleOnGrowthOnly = !(kHeadDim == 128 && kBlockN == 176);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;
};

template <typename Element, int kHeadDim, bool kCausal>
struct FwdConfig;
template <typename Element, bool kCausal>
struct FwdConfig<Element, 64, kCausal> { using Traits = FwdTraits<Element, 64, 192, 128, 2>; };
// Non-causal H 128 takes 176 keys per tile (fewer softmax row reductions and barrier rounds per
// FLOP; O then reuses Q's smem); causal keeps 128 so the diagonal tiles waste less.
template <typename Element, bool kCausal>
struct FwdConfig<Element, 128, kCausal> {
  using Traits = FwdTraits<Element, 128, 128, kCausal ? 128 : 176, 2>;
};
template <typename Element, bool kCausal>
struct FwdConfig<Element, 256, kCausal> { using Traits = FwdTraits<Element, 256, 128, 80, 2>; };

// The general (masked) path's tiles: the plain causal ones, except where the policy code needs the
// registers. H 64: 192 x 112 (192 x 128 spills in the policy code at 160 registers per consumer);
// the kernels of the smaller policy sets (kLean: position tests alone, kPolicyPositions, and with
// segment ids besides, kPolicySegments) fit plain causal's 192 x 128. H 256: 128 x 64 (S beside O's
// 128 floats per thread). H 128: causal's 128 x 128 (4096-key segments end on 128-key tiles).
template <typename Element, int kHeadDim, bool kLean = false>
struct GeneralFwdConfig {
  using Traits = typename FwdConfig<Element, kHeadDim, true>::Traits;
};
template <typename Element, bool kLean>
struct GeneralFwdConfig<Element, 64, kLean> {
  using Traits = FwdTraits<Element, 64, 192, kLean ? 128 : 112, 2>;
};
template <typename Element, bool kLean>
struct GeneralFwdConfig<Element, 256, kLean> { using Traits = FwdTraits<Element, 256, 128, 64, 2>; };

// Dropout's tiles: the general ones with two consumers (its Philox calls need registers that H 64's
// three consumers at 160 registers each do not have).
template <typename Element, int kHeadDim>
struct DropoutFwdConfig {
  using Traits = typename GeneralFwdConfig<Element, kHeadDim>::Traits;
};
template <typename Element>
struct DropoutFwdConfig<Element, 64> { using Traits = FwdTraits<Element, 64, 128, 128, 2>; };

// ALiBi's k prefix operand in smem (fwd_mainloop.h): none, or the keys' side, one row per key.
template <typename Traits, bool kAlibiPrefix>
struct AlibiPrefixStorage {};
template <typename Traits>
struct AlibiPrefixStorage<Traits, true> {
  using Element = typename Traits::Element;
  // The 32-byte swizzle repeats every 256 bytes (8 rows of 32), the alignment wgmma needs here.
  alignas(256) cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutKPrefix>> k;
};

// Shared memory of one CTA. Buffers read by wgmma with the 128-byte swizzle are 1024-byte aligned.
// kAlibiPrefix adds the keys' side of ALiBi's k prefix of Q·Kᵀ (fwd_mainloop.h): 4 KB at 128 keys.
// H 256's 128 x 80 has no room even for that (231424 of the 232448 bytes without it), so its ALiBi
// kernel runs on the general tile, 128 x 64 (GeneralFwdConfig).
template <typename Traits, bool kAlibiPrefix = false>
struct FwdSharedStorage {
  using Element = typename Traits::Element;
  static constexpr int kOElems = Traits::kOAliasesQ ? 0 : int(cosize_v<typename Traits::SmemLayoutO>);
  alignas(1024) cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutQ>> q;
  alignas(1024) cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutK>> k;
  alignas(1024) cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutV>> v;
  alignas(1024) cute::array_aligned<Element, kOElems == 0 ? 1 : kOElems> o;
  AlibiPrefixStorage<Traits, kAlibiPrefix> prefix;
  typename Traits::Pipeline::SharedStorage pipeline_k;
  typename Traits::Pipeline::SharedStorage pipeline_v;
  cutlass::arch::ClusterTransactionBarrier q_full;  // Q of the current tile has landed
  cutlass::arch::ClusterBarrier q_empty;            // consumers are done with Q (and O if aliased)
  // The tile after tile i, in next_work[(i + 1) % 2] (TileWork::tile >= num_tiles: none). Once
  // per tile, and once more at the end, the producer warp and each consumer warpgroup meet at a
  // named barrier (all blocking, so that racecheck sees the order too): the producer writes tile
  // i + 1 after the meeting of tile i, the consumers read it after the meeting of tile i + 1
  // (where the producer is loading it). Two slots: the write of tile i + 2 (after that meeting)
  // cannot touch the slot still being read, which every consumer read before arriving there.
  TileWork next_work[2];
  // The key block of each K stage on the kernels of the boolean mask, per phase (fwd_params.h,
  // FwdBlockInfo and block_info_slot).
  int block_info[2][Traits::kStages];
  // One word per consumer thread that softmax_done() stores to (never read).
  float softmax_sink[Traits::kNumMmaThreads];
};

}  // namespace jfa::sm90
