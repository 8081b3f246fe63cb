// Small device helpers of the sm90 kernels: wgmma issue, accumulator layout views, conversions.
#pragma once

// Without it CuTe's GMMA op selectors only pick N in {8, 16, 24, 32, 64, 96, 128, 192, 256}-like
// divisors and split an 80-key tile into five N = 16 instructions (each re-reading its A operand).
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#error "compile the sm90 kernels with -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (cuda/sm90/CMakeLists.txt)"
#endif

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>

namespace jfa::sm90 {

using namespace cute;

// Issues one warpgroup GEMM C (+)= A·B over all k blocks as a single wgmma batch. kWait >= 0
// waits until at most kWait batches are in flight; -1 returns with the batch in flight, so the
// caller can overlap it (softmax under Q·Kᵀ, the other warpgroup's work under P·V).
template <bool kZeroInit, int kWait, typename TiledMma, typename TA, typename TB, typename TC>
__forceinline__ __device__ void gemm(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC) {
  constexpr bool kIsRS = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kIsRS) warpgroup_fence_operand(const_cast<TA&>(tCrA));
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (kZeroInit) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(tCrC);
  if constexpr (kIsRS) warpgroup_fence_operand(const_cast<TA&>(tCrA));
}

// C = A'·B' + A·B as a single wgmma batch: the prefix pair first (an RS wgmma, A' in registers,
// through its own tiled MMA), which zero-initialises C, then the k blocks of (A, B) from smem.
template <typename PrefixMma, typename TiledMma, typename TPA, typename TPB, typename TA, typename TB, typename TC>
__forceinline__ __device__ void gemm_with_prefix(PrefixMma& prefix_mma, TiledMma& tiled_mma, TPA& tCrA_prefix,
                                                 TPB const& tCrB_prefix, TA const& tCrA, TB const& tCrB, TC& tCrC) {
  warpgroup_fence_operand(tCrA_prefix);
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  prefix_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA_prefix); ++k) {
    cute::gemm(prefix_mma, tCrA_prefix(_, _, k), tCrB_prefix(_, _, k), tCrC);
    prefix_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
  warpgroup_commit_batch();
  warpgroup_fence_operand(tCrC);
  warpgroup_fence_operand(tCrA_prefix);
}

// Marks the end of a block's softmax before the wait for the P·V GEMM that runs under it. ptxas
// schedules wgmma.wait_group as early as the memory operations around it allow (its SASS,
// WARPGROUP.DEPBAR, came right after the K release), which put the wait for P·V(n + 1) before the
// softmax of block n: the softmax never overlapped its own warpgroup's P·V, only the other
// warpgroup's GEMMs (the same in FlashAttention-3's sm90 kernels, cuobjdump of flash_attn3_jax
// 0.2.3). A shared-memory store of a value the softmax computes last keeps the wait after it:
// three instructions per block (an address, an add, the store), the word is never read.
__forceinline__ __device__ void softmax_done(float& smem_sink, float value) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(cute::cast_smem_ptr_to_uint(&smem_sink)), "f"(value) : "memory");
}

// wgmma accumulator ((2, 2, N/8), M, N) -> (rows, cols) = ((2, M), (2, N/8, N)): a thread holds
// 2 rows per 64-row atom, each with N/4 columns spread over the 4 threads of a quad.
template <typename Layout>
__forceinline__ __device__ auto acc_rowcol(Layout l) {
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The Q·Kᵀ accumulator of a warpgroup has exactly the register layout wgmma wants for a 16-bit
// A operand: ((2, 2, N/8), M, 1) -> ((2, 2, 2), M, N/16) k-blocks of 16 keys. So P never leaves
// registers.
template <typename Layout>
__forceinline__ __device__ auto acc_as_a_operand(Layout l) {
  auto k = logical_divide(get<0, 2>(l), Tile<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(k)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(k), get<2>(l))));
}

// This thread's consumer (MMA) warpgroup, 0, 1, ... (warpgroup 0 is the producer), as a warp-
// uniform value: named barrier ids derived from it stay in uniform registers, where one computed
// from threadIdx.x alone costs a loop that makes it uniform around every bar.sync.
__forceinline__ __device__ int mma_warp_group() { return cutlass::canonical_warp_group_idx() - 1; }

// dst = convert(src), element-wise, with the vectorised cvt (two floats per instruction).
template <typename TSrc, typename TDst>
__forceinline__ __device__ void convert(TSrc const& src, TDst& dst) {
  using From = typename TSrc::value_type;
  using To = typename TDst::value_type;
  constexpr int kN = decltype(size(src))::value;
  static_assert(kN == decltype(size(dst))::value);
  cutlass::NumericArrayConverter<To, From, kN> op;
  *reinterpret_cast<cutlass::Array<To, kN>*>(raw_pointer_cast(dst.data())) =
      op(*reinterpret_cast<const cutlass::Array<From, kN>*>(raw_pointer_cast(src.data())));
}

__forceinline__ __device__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__forceinline__ __device__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// A 16-byte float add into global memory whose result is not read, as a reduction (red): ptxas may
// keep an atomicAdd with an unused result as an atom that waits for its reply (it did for the
// split-head dQ adds once the ordered adds of deterministic=True put a fence after them).
__forceinline__ __device__ void red_add_f32x4(float* address, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(address), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}

// The same for one float (d(bias)'s per-element adds).
__forceinline__ __device__ void red_add_f32(float* address, float a) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(address), "f"(a) : "memory");
}

// Adds a warpgroup's accumulator into `share` in global memory with 16-byte float reductions,
// value group g (4 floats) of thread t at float (g·128 + t)·4: a warpgroup's adds cover contiguous
// spans, and a reader that knows the accumulator's layout finds every value's coordinates.
template <typename Acc>
__forceinline__ __device__ void atomic_add_share(Acc const& acc, float* share, int wg_tid) {
  constexpr int n = decltype(size(acc))::value;
  static_assert(n % 4 == 0);
  float* const mine = share + 4 * wg_tid;  // + a constant per group: immediate offsets in the SASS
  CUTE_UNROLL
  for (int g = 0; g < n / 4; ++g)
    red_add_f32x4(mine + g * 512, acc(4 * g), acc(4 * g + 1), acc(4 * g + 2), acc(4 * g + 3));
}

}  // namespace jfa::sm90
