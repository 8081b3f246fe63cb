// Tile shapes, thread roles, smem layouts and wgmma atoms of the Hopper (sm90a) backward.
//
// A CTA owns one key block of kBlockN = 128 keys of one K/V head (and walks the query blocks of
// its group's query heads), with one producer warpgroup and two MMA warpgroups of 64 keys each.
// Every GEMM of a step is laid out so that the two of them that produce dV and dK take their A
// operand from registers:
//   Sᵀ  = K·Qᵀ   (M = keys, N = queries, K = H)   SS   the transposed scores ("SdP swapAB")
//   dPᵀ = V·dOᵀ  (M = keys, N = queries, K = H)   SS
//   dV += Pᵀ·dO  (M = keys, N = H, K = queries)   RS   Pᵀ is the Sᵀ accumulator, converted
//   dK += dSᵀ·Q  (M = keys, N = H, K = queries)   RS   the same for dSᵀ
//   dQ  = dS·K   (M = queries, N = H, K = keys)   SS   dS from smem (it needs both warpgroups' keys)
//   or dQᵀ = Kᵀ·dSᵀ (M = H, N = queries, K = keys) where kBlockM is not a multiple of wgmma's 64 rows
// A warpgroup's Sᵀ accumulator has the register layout wgmma wants for an A operand of 64 keys,
// so P and dS never go through smem for dV and dK; only dS is stored, for dQ. dQ is a partial
// sum over key blocks: each warpgroup stages its share in smem as float32 and a dQ writer warp of
// the producer warpgroup adds it into the global accumulator with one bulk reduction
// (bwd_producer.h), off the MMA warpgroups' path.
// Tile table (FlashAttention-3's H100 choices, checked against 227 KB smem and 240 registers per
// MMA thread; per MMA thread dK + dV hold 2·64·H/128 floats, Sᵀ + dPᵀ 2·64·kBlockM/128, dQ
// kBlockM·H/256):
//   H  64: 128 x 128  dK+dV 64, Sᵀ+dPᵀ 128, dQ 32 registers; smem Q, dO 2 x 2 x 16, K, V 2 x 16,
//          dS 2 x 32, dQ 32 KB = 194 KB. The query block is as tall as registers allow: a step's
//          fixed costs (barriers, waits, stats) spread over more keys·queries.
//   H 128:  64 x 128  dK+dV 128, Sᵀ+dPᵀ 64, dQ 32; smem Q, dO 2 x 2 x 16, K, V 2 x 32, dS 2 x 16,
//          dQ 32 KB = 193 KB. Causal, and every kernel of the general path: the diagonal blocks
//          of 64 rows mask less, and masks' tile summaries cover 64 rows.
//          80 x 128 without causality or masks: dK+dV 128, Sᵀ+dPᵀ 80, dQᵀ 40; smem Q, dO
//          2 x 2 x 20, K, V 2 x 32, dS 2 x 20, dQ 40 KB = 226 KB. A quarter more queries per step
//          for the same fixed costs; dQ is computed transposed (80 rows are no wgmma M).
// Q, dO and dS have two stages, so the next step's loads land and a warpgroup may write the next
// dS while the other still reads the last one in its dQ GEMM.
#pragma once

#include <type_traits>

#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "jfa/params.h"
#include "tma.h"
#include "utils.h"

namespace jfa::sm90 {

using namespace cute;

// What both layouts share: the CTA's threads and registers, the Q, dO, K, V tiles (Q and dO in a
// 2-stage ring, with their transposed views for dK and dV: (H, queries), and K's for dQ: (H,
// keys)), the dQ share order and the load sizes.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_>
struct BwdTraitsBase {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kStages = 2;
  static constexpr int kNumMmaWarpGroups = 2;
  static_assert(kBlockM % 16 == 0 && kHeadDim % 64 == 0 && kBlockM <= 128);
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * 128;
  static constexpr int kNumThreads = kNumMmaThreads + 128;  // + the producer warpgroup
  static constexpr int kLoadRegs = 24;
  static constexpr int kMmaRegs = 240;
  static_assert(kLoadRegs * 128 + kMmaRegs * kNumMmaThreads <= 65536 / kNumThreads / 8 * 8 * kNumThreads,
                "setmaxnreg budget exceeds the registers the CTA is launched with");

  using SmemAtom = SmemAtomSw128<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutdO = SmemLayoutQ;
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = SmemLayoutK;
  // Transposed views (the same bytes), MN-major operands: N or M = H is contiguous.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutdOt = SmemLayoutQt;
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));

  // A warpgroup's dQ share: its accumulator values in its own order, value group g (4 floats) of
  // thread t at float (g·128 + t)·4, so that a warpgroup's 16-byte writes are contiguous; the global
  // accumulator's query block holds the warpgroups' shares one after the other in the same order
  // (bwd_postprocess.h reads it back).
  static constexpr int kDqSliceFloats = kBlockM * kHeadDim / kNumMmaWarpGroups;
  static constexpr int kDqSliceBytes = kDqSliceFloats * 4;
  // The dQ accumulator: (queries, H), or (H, queries) where dQᵀ is computed (BwdTraits).
  static constexpr bool kDqTransposed = false;
  using AccShapedQ = Shape<Int<kBlockM>, Int<kHeadDim>>;

  static constexpr int kQBytes = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kKVBytes = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kRowStatsBytes = kBlockM * 4;
  // dK and dV are staged for their TMA stores in the Q and dO buffers (free by then).
  static_assert(cosize_v<SmemLayoutQ> >= kBlockN * kHeadDim);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;
};

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_ = 128>
struct BwdTraits : BwdTraitsBase<Element_, kHeadDim_, kBlockM_, kBlockN_> {
  using Base = BwdTraitsBase<Element_, kHeadDim_, kBlockM_, kBlockN_>;
  using typename Base::Element;
  using typename Base::ElementAccum;
  using typename Base::SmemAtom;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDim, Base::kNumMmaWarpGroups, Base::kStages;
  static constexpr bool kSplitHead = false;
  // deterministic=True: the lanes of the dQ accumulator (bwd_dq_order.h) that the producer's writer
  // warp adds into on the plain path (bwd_dq_lanes). Two at H 64, where a key block then waits only
  // for the one two below it; one from H 128 on, where the second lane's traffic (zeroed, held in
  // L2, added up in the conversion) costs more than the shorter chain saves (docs/performance.md).
  static constexpr int kDeterministicDqLanes = kHeadDim <= 64 ? int(kDqLanes) : 1;
  using AccShapeKV = Shape<Int<kBlockN>, Int<kHeadDim>>;  // the dK and dV accumulators: (keys, H)
  static_assert(kBlockN == 64 * kNumMmaWarpGroups, "each MMA warpgroup owns 64 keys (wgmma's M)");

  // dQ = dS·K splits its queries over the warpgroups where there are 128 of them, else its head
  // dim. A query block that is not a multiple of 64 rows computes dQᵀ = Kᵀ·dSᵀ instead, each
  // warpgroup 64 of the head dims (its M), as FlashAttention-3 does for its 80-row blocks.
  static constexpr bool kDqTransposed = kBlockM % 64 != 0;
  static_assert(!kDqTransposed || kHeadDim == 64 * kNumMmaWarpGroups);
  using AccShapedQ = std::conditional_t<kDqTransposed, Shape<Int<kHeadDim>, Int<kBlockM>>, Shape<Int<kBlockM>, Int<kHeadDim>>>;
  static constexpr int kDqWarpGroupsM = kDqTransposed ? 1 : kBlockM / 64;
  static constexpr int kDqWarpGroupsN = kNumMmaWarpGroups / kDqWarpGroupsM;

  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>{}));
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>{}));
  // (Where dQᵀ is computed, TiledMmadQRows is a 64-row stand-in that nothing uses: wgmma has no
  // 80-row atom to build it from.)
  using TiledMmadQRows = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum,
                           Shape<Int<kDqTransposed ? 64 : kBlockM>, Int<kHeadDim / kDqWarpGroupsN>, Int<kBlockN>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      Layout<Shape<Int<kDqWarpGroupsM>, Int<kDqWarpGroupsN>, _1>>{}));
  using TiledMmadQColumns = decltype(make_tiled_mma(  // dQᵀ: A = Kᵀ (H, keys), B = dS (queries, keys)
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockM>, Int<kBlockN>>, GMMA::Major::MN,
                           GMMA::Major::K>(),
      Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>{}));
  using TiledMmadQ = std::conditional_t<kDqTransposed, TiledMmadQColumns, TiledMmadQRows>;

  // dS as the dQ GEMM's A operand: (queries, keys), keys contiguous; viewed as (keys, queries) for
  // the Sᵀ accumulator's threads, which store dSᵀ transposed (stmatrix .trans), 8 values each.
  using SmemLayoutdS = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kBlockN>, Int<kStages>>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemCopyAtomdS = Copy_Atom<SM90_U16x8_STSM_T, Element>;
  static_assert((kBlockM * kBlockN / Base::kNumMmaThreads) % 8 == 0);
};

// H 256: dK and dV of 64 keys hold 2·64·256/128 = 256 floats per thread of a warpgroup that owns
// those keys, more than its 240 registers. So the warpgroups split the head dim instead: each
// holds dKᵀ and dVᵀ for its 128 of the 256 dims and every key of a 64-key block (128 floats), and
// the step's GEMMs are laid out the other way round (bwd_mainloop_split_head.h):
//   S  = Q·Kᵀ    (M = queries, N = keys, K = H)    SS   each warpgroup 32 of the 64 keys
//   dP = dO·Vᵀ   (M = queries, N = keys, K = H)    SS
//   dVᵀ += dOᵀ·P (M = H, N = keys, K = queries)   SS   P from smem (it needs every key)
//   dKᵀ += Qᵀ·dS (M = H, N = keys, K = queries)   SS   dS from smem
//   dQ  = dS·K   (M = queries, N = H, K = keys)    SS   each warpgroup 128 of the 256 dims
// Registers per MMA thread: dKᵀ + dVᵀ 128, S + dP 32, dQ 64. The float32 dQ share (64 KB) has no
// room in smem beside Q, dO (2 stages each), K, V, P and dS (2 stages each: 225 KB), so each thread
// adds it into the global accumulator with 16-byte atomics, in the share order of the base.
template <typename Element_, int kHeadDim_>
struct BwdTraitsSplitHead : BwdTraitsBase<Element_, kHeadDim_, 64, 64> {
  using Base = BwdTraitsBase<Element_, kHeadDim_, 64, 64>;
  using typename Base::Element;
  using typename Base::ElementAccum;
  using typename Base::SmemAtom;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDim, Base::kStages;
  static constexpr bool kSplitHead = true;
  // deterministic=True: every lane of the dQ accumulator (bwd_dq_order.h), since the warpgroups
  // themselves wait for their turns here.
  static constexpr int kDeterministicDqLanes = int(kDqLanes);
  using AccShapeKV = Shape<Int<kHeadDim>, Int<kBlockN>>;  // dKᵀ and dVᵀ: (H, keys)
  static_assert(kHeadDim % 128 == 0);

  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockM>, Int<kBlockN / 2>, Int<kHeadDim>>>(),
      Layout<Shape<_1, _2, _1>>{}));
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<Int<kHeadDim>, Int<kBlockN>, Int<kBlockM>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockM>, Int<kHeadDim / 2>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_1, _2, _1>>{}));

  // P and dS as (queries, keys), keys contiguous: dQ's A operand, and (transposed) the B operand of
  // dKᵀ and dVᵀ ((keys, queries), MN-major). dK and dV leave through K's transposed view.
  using SmemLayoutPdS = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kBlockN>, Int<kStages>>{}));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemCopyAtomPdS = Copy_Atom<SM90_U32x4_STSM_N, Element>;
  using SmemCopyAtomdKV = Copy_Atom<SM90_U16x8_STSM_T, Element>;
};

// Traits: causal calls and the general path; PlainTraits: calls without causality or masks.
template <typename Element, int kHeadDim>
struct BwdConfig;
template <typename Element>
struct BwdConfig<Element, 64> {
  using Traits = BwdTraits<Element, 64, 128>;
  using PlainTraits = Traits;
};
template <typename Element>
struct BwdConfig<Element, 128> {
  using Traits = BwdTraits<Element, 128, 64>;
  using PlainTraits = BwdTraits<Element, 128, 80>;
};
template <typename Element>
struct BwdConfig<Element, 256> {
  using Traits = BwdTraitsSplitHead<Element, 256>;
  using PlainTraits = Traits;
};

// The smem each layout needs beyond Q, dO, K, V and the row statistics: dS and the staged dQ
// shares (BwdTraits); P and dS (BwdTraitsSplitHead).
template <typename Traits, bool kSplitHead = Traits::kSplitHead>
struct BwdStepStorage {
  alignas(1024) cute::array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutdS>> ds;
  alignas(128) float dq[Traits::kNumMmaWarpGroups][Traits::kDqSliceFloats];
};
template <typename Traits>
struct BwdStepStorage<Traits, true> {
  alignas(1024) cute::array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutPdS>> p;
  alignas(1024) cute::array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutPdS>> ds;
};

template <typename Traits>
struct BwdSharedStorage {
  using Element = typename Traits::Element;
  alignas(1024) cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutQ>> q;
  alignas(1024) cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutdO>> dout;
  alignas(1024) cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutK>> k;
  alignas(1024) cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutV>> v;
  BwdStepStorage<Traits> step;
  // Per stage: LSE·log2 e and D of the step's query rows (with Q and with dO).
  alignas(128) float lse_log2[Traits::kStages][Traits::kBlockM];
  alignas(128) float d[Traits::kStages][Traits::kBlockM];
  float slope_sums[2][Traits::kNumMmaThreads / 32];  // d(ALiBi slopes): per step parity and MMA warp (bwd_general.h)
  typename Traits::Pipeline::SharedStorage pipeline_q;
  typename Traits::Pipeline::SharedStorage pipeline_do;
  cutlass::arch::ClusterTransactionBarrier kv_full;  // K and V of the CTA's key block have landed
};

}  // namespace jfa::sm90
