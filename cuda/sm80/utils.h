// Small device helpers of the sm80 kernels: register-level gemms over smem tiles, accumulator
// layout views, type conversion and bounds-predicated tile copies.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace jfa::sm80 {

using namespace cute;

// acc += A·Bᵀ with both operands in smem: ldmatrix the next k-slice while the mma of this one runs.
template <typename Acc, typename RegA, typename RegB, typename SmemA, typename SmemB, typename TiledMma,
          typename CopyA, typename CopyB, typename ThrCopyA, typename ThrCopyB>
__forceinline__ __device__ void gemm_ss(Acc& acc, RegA& rA, RegB& rB, SmemA const& sA, SmemB const& sB,
                                        TiledMma const& mma, CopyA const& copy_a, CopyB const& copy_b,
                                        ThrCopyA const& thr_copy_a, ThrCopyB const& thr_copy_b) {
  Tensor rA_view = thr_copy_a.retile_D(rA);
  Tensor rB_view = thr_copy_b.retile_D(rB);
  cute::copy(copy_a, sA(_, _, _0{}), rA_view(_, _, _0{}));
  cute::copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      cute::copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      cute::copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A·Bᵀ with A already in registers (P in the forward P·V).
template <typename Acc, typename RegA, typename RegB, typename SmemB, typename TiledMma, typename CopyB,
          typename ThrCopyB>
__forceinline__ __device__ void gemm_rs(Acc& acc, RegA const& rA, RegB& rB, SmemB const& sB, TiledMma const& mma,
                                        CopyB const& copy_b, ThrCopyB const& thr_copy_b) {
  Tensor rB_view = thr_copy_b.retile_D(rB);
  cute::copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) cute::copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// View an m16n8 accumulator (MMA=4, MMA_M, MMA_N) as (rows=(2, MMA_M), cols=(2, MMA_N)).
template <typename Layout>
__forceinline__ __device__ auto acc_rowcol(Layout acc) {
  static_assert(decltype(size<0>(acc))::value == 4 && decltype(rank(acc))::value == 3);
  auto l = logical_divide(acc, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// View an m16n8k16 accumulator (4, MMA_M, MMA_N) as an A operand ((4, 2), MMA_M, MMA_N / 2):
// the C fragment of two adjacent n8 tiles is exactly the A fragment of one k16 slice.
template <typename Layout>
__forceinline__ __device__ auto acc_as_a_operand(Layout acc) {
  static_assert(decltype(size<0>(acc))::value == 4 && decltype(rank(acc))::value == 3);
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // (4, MMA_M, (2, MMA_N / 2))
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// Element-wise conversion of a register tensor (fp32 -> fp16/bf16), vectorized by CUTLASS.
// Returns an owning register tensor of the same (static) layout.
template <typename To, typename Engine, typename Layout>
__forceinline__ __device__ auto convert_type(Tensor<Engine, Layout> const& t) {
  using From = typename Engine::value_type;
  constexpr int n = decltype(size(t))::value;
  cutlass::NumericArrayConverter<To, From, n> op;
  Tensor out = make_tensor<To>(t.layout());
  *reinterpret_cast<cutlass::Array<To, n>*>(out.data()) =
      op(*reinterpret_cast<cutlass::Array<From, n> const*>(t.data()));
  return out;
}

// Tile copy global -> smem where rows at or past `max_rows` are not read; with kClear they are
// zero-filled so that they contribute exact zeros to every gemm.
template <bool kClear, typename TiledCopy, typename Src, typename Dst, typename Coord>
__forceinline__ __device__ void copy_rows(TiledCopy const& tiled_copy, Src const& src, Dst& dst,
                                          Coord const& coord, int max_rows) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) < max_rows) {
      cute::copy(tiled_copy, src(_, m, _), dst(_, m, _));
    } else if (kClear) {
      cute::clear(dst(_, m, _));
    }
  }
}

template <int N>
__forceinline__ __device__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <typename T>
__forceinline__ __device__ T quad_allreduce_max(T x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
}

template <typename T>
__forceinline__ __device__ T quad_allreduce_sum(T x) {
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x + __shfl_xor_sync(0xffffffffu, x, 1);
}

}  // namespace jfa::sm80
