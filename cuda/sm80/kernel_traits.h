// Tile sizes and CuTe layouts of the sm80 kernels: one place that says how a CTA is shaped.
//
// Forward tile table (kBlockM x kBlockN, warps), all rows of a query tile split over warps (16 each):
//   hdim  32: 128 x 128, 4 warps   small hdim: large key tiles amortize the softmax per mma.
//   hdim  64: 128 x 128, 4 warps   same; smem 16 + 32 KB.
//   hdim  96: 128 x  64, 4 warps   acc_o (48 f32) + acc_s (32) per thread stay below 255 registers.
//   hdim 128: 128 x  64, 4 warps   FA2's A100/H100 choice: 64 KB smem, 2 CTAs per SM on A100.
//   hdim 192: 128 x  64, 8 warps   acc_o is 96 f32 per thread with 8 warps; 96 KB smem.
//   hdim 256: 128 x  64, 8 warps   acc_o is 128 f32 per thread; 128 KB smem (fits A100's 164 KB).
// Backward tile table (kBlockM x kBlockN, 8 warps, warp layouts of the S/dP, dK/dV and dQ gemms):
//   hdim  32: 128 x 128, (4,4,4)   dK/dV accumulators are tiny; big tiles cut dQ atomics per flop.
//   hdim  64: 128 x 128, (2,4,4)   144 KB smem; dK+dV = 64 f32 per thread.
//   hdim  96:  64 x 128, (2,4,4)   dK+dV = 96 f32 per thread; 116 KB smem.
//   hdim 128:  64 x 128, (2,4,2)   FA2's choice: dK+dV = 128 f32 per thread; 144 KB smem.
//   hdim 192:  64 x  64, (4,2,2)   dK+dV = 96 f32 per thread; 136 KB smem.
//   hdim 256:  64 x  64, (4,2,2)   single-buffered Q so smem is 144 KB and fits A100 (164 KB).
// Every tile keeps kBlockM a multiple of kBlockN or vice versa so causal diagonals are simple.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace jfa::sm80 {

using namespace cute;

// Pieces shared by the forward and backward traits.
template <typename Element_, int kHeadDim_, int kNWarps_>
struct BaseTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0);

  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                     MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;            // ldmatrix
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;  // ldmatrix.trans
  using SmemCopyAtomStore = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // Swizzled smem: rows of 64 (or 32) elements, XOR-swizzled so ldmatrix and cp.async are
  // conflict-free. Tiles wider than 64 are made of several such column "pages".
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kBlockKSmem == 32 ? 2 : 3;
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSwizzle, 3, 3>{}, Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));

  // Global <-> smem copies: 16-byte cp.async per thread, a row page read by kGmemThreadsPerRow threads.
  static constexpr int kGmemElemsPerLoad = 16 / sizeof(Element);
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerLoad;
  using GmemLayoutAtom = Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                                Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopyLoad = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, Int<kGmemElemsPerLoad>>>{}));
  using GmemTiledCopyStore = decltype(make_tiled_copy(
      Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, Int<kGmemElemsPerLoad>>>{}));
};

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct FwdTraits : BaseTraits<Element_, kHeadDim_, kNWarps_> {
  using Base = BaseTraits<Element_, kHeadDim_, kNWarps_>;
  using Element = typename Base::Element;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;

  // Warps tile the M dimension only, so each warp owns whole rows and the softmax needs no smem.
  using TiledMma = TiledMMA<typename Base::MmaAtom, Layout<Shape<Int<kNWarps>, _1, _1>>,
                            Tile<Int<16 * kNWarps>, _16, _16>>;

  using SmemLayoutQ = decltype(tile_to_shape(typename Base::SmemLayoutAtom{},
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(typename Base::SmemLayoutAtom{},
                                              Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V viewed as [hdim, kBlockN] for the P·V gemm (read with ldmatrix.trans).
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutO = SmemLayoutQ;

  static constexpr int kSmemSize =
      int(sizeof(Element)) * (int(size(SmemLayoutQ{})) + 2 * int(size(SmemLayoutKV{})));
};

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_,
          int kAtomMSdP_, int kAtomNdKV_, int kAtomMdQ_, bool kDoubleBufferQ_>
struct BwdTraits : BaseTraits<Element_, kHeadDim_, kNWarps_> {
  using Base = BaseTraits<Element_, kHeadDim_, kNWarps_>;
  using Element = typename Base::Element;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr bool kDoubleBufferQ = kDoubleBufferQ_;
  static_assert(kNWarps % kAtomMSdP_ == 0 && kNWarps % kAtomNdKV_ == 0 && kNWarps % kAtomMdQ_ == 0);

  // S = Q·Kᵀ and dP = dO·Vᵀ: [kBlockM, kBlockN].
  using TiledMmaSdP = TiledMMA<typename Base::MmaAtom, Layout<Shape<Int<kAtomMSdP_>, Int<kNWarps / kAtomMSdP_>, _1>>,
                               Tile<Int<16 * kAtomMSdP_>, Int<16 * kNWarps / kAtomMSdP_>, _16>>;
  // dK = dSᵀ·Q and dV = Pᵀ·dO: [kBlockN, hdim].
  using TiledMmadKV = TiledMMA<typename Base::MmaAtom, Layout<Shape<Int<kAtomNdKV_>, Int<kNWarps / kAtomNdKV_>, _1>>,
                               Tile<Int<16 * kAtomNdKV_>, Int<16 * kNWarps / kAtomNdKV_>, _16>>;
  // dQ = dS·K: [kBlockM, hdim].
  using TiledMmadQ = TiledMMA<typename Base::MmaAtom, Layout<Shape<Int<kAtomMdQ_>, Int<kNWarps / kAtomMdQ_>, _1>>,
                              Tile<Int<16 * kAtomMdQ_>, Int<16 * kNWarps / kAtomMdQ_>, _16>>;

  using SmemLayoutQdO = decltype(tile_to_shape(typename Base::SmemLayoutAtom{},
                                               Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutQdOt = decltype(composition(
      SmemLayoutQdO{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutQdOtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutQdOt{}));

  using SmemLayoutKV = decltype(tile_to_shape(typename Base::SmemLayoutAtom{},
                                              Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutKtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutKt{}));

  // P and dS tiles [kBlockM, kBlockN], written from the S/dP accumulators, read both ways.
  static constexpr int kPBlockN = kBlockN >= 64 ? 64 : 32;
  using SmemLayoutAtomPdS = decltype(composition(
      Swizzle<3, 3, 3>{}, Layout<Shape<Int<kBlockM>, Int<kPBlockN>>, Stride<Int<kPBlockN>, _1>>{}));
  using SmemLayoutPdS = decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));

  // dK/dV staging for the coalesced epilogue (reuses the sK/sV area).
  using SmemLayoutdKV = SmemLayoutKV;

  static constexpr int kSmemQSize = int(size(SmemLayoutQdO{})) * int(sizeof(Element));
  static constexpr int kSmemKVSize = int(size(SmemLayoutKV{})) * int(sizeof(Element));
  static constexpr int kSmemPSize = int(size(SmemLayoutPdS{})) * int(sizeof(Element));
  static constexpr int kSmemSize =
      kSmemQSize * (kDoubleBufferQ ? 3 : 2) + 2 * kSmemKVSize + 2 * kSmemPSize;
};

// The tile table above, as types.
template <typename Element, int kHeadDim> struct FwdConfig;
template <typename E> struct FwdConfig<E, 32> { using Traits = FwdTraits<E, 32, 128, 128, 4>; };
template <typename E> struct FwdConfig<E, 64> { using Traits = FwdTraits<E, 64, 128, 128, 4>; };
template <typename E> struct FwdConfig<E, 96> { using Traits = FwdTraits<E, 96, 128, 64, 4>; };
template <typename E> struct FwdConfig<E, 128> { using Traits = FwdTraits<E, 128, 128, 64, 4>; };
template <typename E> struct FwdConfig<E, 192> { using Traits = FwdTraits<E, 192, 128, 64, 8>; };
template <typename E> struct FwdConfig<E, 256> { using Traits = FwdTraits<E, 256, 128, 64, 8>; };

template <typename Element, int kHeadDim> struct BwdConfig;
template <typename E> struct BwdConfig<E, 32> { using Traits = BwdTraits<E, 32, 128, 128, 8, 4, 4, 4, true>; };
template <typename E> struct BwdConfig<E, 64> { using Traits = BwdTraits<E, 64, 128, 128, 8, 2, 4, 4, true>; };
template <typename E> struct BwdConfig<E, 96> { using Traits = BwdTraits<E, 96, 64, 128, 8, 2, 4, 4, true>; };
template <typename E> struct BwdConfig<E, 128> { using Traits = BwdTraits<E, 128, 64, 128, 8, 2, 4, 2, true>; };
template <typename E> struct BwdConfig<E, 192> { using Traits = BwdTraits<E, 192, 64, 64, 8, 4, 2, 2, true>; };
template <typename E> struct BwdConfig<E, 256> { using Traits = BwdTraits<E, 256, 64, 64, 8, 4, 2, 2, false>; };

// The general backward (masks, score modifiers, dropout: launch.h) where its per-element policy
// code wants a smaller tile than the plain one: at H 64, 64 x 128 spills a small fraction of what
// 128 x 128 does and runs faster; H 128 keeps 64 x 128, as 64 x 64 doubles the dQ adds (figures:
// docs/performance.md, "Backward: design measurements").
template <typename Element, int kHeadDim> struct GeneralBwdConfig : BwdConfig<Element, kHeadDim> {};
template <typename E> struct GeneralBwdConfig<E, 64> { using Traits = BwdTraits<E, 64, 64, 128, 8, 2, 4, 4, true>; };

}  // namespace jfa::sm80
