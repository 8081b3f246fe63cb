// The Hopper backward's last kernel: dQ = scale · (the float32 accumulator), to the input dtype;
// with deterministic=True the accumulator's lanes that the kernel used (bwd_dq_order.h) added up
// first, lane 0 first.
// One CTA per (query block, query head, batch), one thread per MMA thread of the main kernel: each
// reads back the values that thread staged (bwd_traits.h, kDqSliceFloats' order) and finds their
// (row, column) through the same dQ tiled MMA (or its transpose, AccShapedQ).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "bwd_params.h"
#include "bwd_traits.h"
#include "jfa/params.h"

namespace jfa::sm90 {

using namespace cute;

// This CTA's (block, head, batch) in a grid of one CTA per (block, head, batch), blocks fastest.
__forceinline__ __device__ int3 block_head_batch(int num_blocks, int64_t heads) {
  const int block = int(blockIdx.x % num_blocks);
  const int rest = int(blockIdx.x / num_blocks);
  return make_int3(block, int(rest % heads), int(rest / heads));
}

// kLanes: the accumulator's lanes with deterministic=True (bwd_dq_lanes).
template <typename Traits, int kLanes>
__global__ void __launch_bounds__(Traits::kNumMmaThreads) bwd_convert_dq_kernel(const AttentionParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim, kThreads = Traits::kNumMmaThreads;
  // The block's dQ in smem, so that the stores are whole 16-byte runs of a row whichever way the
  // accumulator holds it; rows padded by 16 bytes, which keeps the column-wise writes of the
  // transposed layout off each other's banks.
  constexpr int kPitch = kHeadDim + 8;
  __shared__ alignas(16) Element tile[kBlockM * kPitch];
  const int3 cta = block_head_batch(int((p.T + kBlockM - 1) / kBlockM), p.N);
  const int m_block = cta.x, head = cta.y, batch = cta.z;
  const int tid = threadIdx.x, w = tid / 128, wg_tid = tid % 128;

  typename Traits::TiledMmadQ mma_dq;
  Tensor coord = mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(typename Traits::AccShapedQ{}));
  constexpr int n = decltype(size(coord))::value;
  const float4* slice = reinterpret_cast<const float4*>(
      p.dq_accum + bwd_row_offset<Traits>(p, batch, head, m_block) * kHeadDim + w * Traits::kDqSliceFloats);
  const int lanes = p.deterministic ? kLanes : 1;
  const int64_t lane_float4s = bwd_dq_lane_floats<kHeadDim>(p) / 4;
  CUTE_UNROLL
  for (int g = 0; g < n / 4; ++g) {
    float4 x = slice[g * 128 + wg_tid];
    for (int lane = 1; lane < lanes; ++lane) {
      const float4 y = slice[lane * lane_float4s + g * 128 + wg_tid];
      x.x += y.x, x.y += y.y, x.z += y.z, x.w += y.w;
    }
    const float v[4] = {x.x, x.y, x.z, x.w};
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const int a = get<0>(coord(4 * g + j)), b = get<1>(coord(4 * g + j));
      const int row = Traits::kDqTransposed ? b : a, col = Traits::kDqTransposed ? a : b;
      tile[row * kPitch + col] = Element(v[j] * p.scale);
    }
  }
  __syncthreads();
  Element* dq = static_cast<Element*>(p.dq) + batch * p.dq_strides.batch + head * p.dq_strides.head;
  const int m0 = m_block * kBlockM;
  const int rows = min(kBlockM, int(p.T) - m0);
  // Columns past H are a wider kernel's zero padding (api.h); H is a multiple of 8.
  constexpr int kRunElems = 16 / int(sizeof(Element));
  const int runs_per_row = int(p.H) / kRunElems;
  const bool aligned = reinterpret_cast<uintptr_t>(dq) % 16 == 0 && p.dq_strides.row % kRunElems == 0;
  if (aligned) {
    for (int i = tid; i < rows * runs_per_row; i += kThreads) {
      const int row = i / runs_per_row, col = (i - row * runs_per_row) * kRunElems;
      *reinterpret_cast<uint4*>(dq + int64_t(m0 + row) * p.dq_strides.row + col) =
          *reinterpret_cast<const uint4*>(&tile[row * kPitch + col]);
    }
  } else {
    for (int i = tid; i < rows * int(p.H); i += kThreads) {
      const int row = i / int(p.H), col = i - row * int(p.H);
      dq[int64_t(m0 + row) * p.dq_strides.row + col] = tile[row * kPitch + col];
    }
  }
}

// dK and dV from the float32 workspace where a GQA group's query heads ran in CTAs of their own:
// one CTA per (key block, K/V head, batch), each thread reading back what the main kernel's thread
// of the same index added (bwd_dkv_share) and finding its coordinates through the same dK/dV tiled
// MMA. dK is scaled already.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNumMmaThreads) bwd_convert_dkv_kernel(const AttentionParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN;
  const int3 cta = block_head_batch(int((p.S + kBlockN - 1) / kBlockN), p.K);
  const int n_block = cta.x, kv_head = cta.y, batch = cta.z;
  const int tid = threadIdx.x, w = tid / 128, wg_tid = tid % 128;

  typename Traits::TiledMmadKV mma_dkv;
  Tensor coord = mma_dkv.get_thread_slice(tid).partition_C(make_identity_tensor(typename Traits::AccShapeKV{}));
  constexpr int n = decltype(size(coord))::value;
  CUTE_UNROLL
  for (int which = 0; which < 2; ++which) {
    const float4* share =
        reinterpret_cast<const float4*>(bwd_dkv_share<Traits>(p, which, batch, kv_head, n_block, w));
    const Strides& st = which == 0 ? p.dk_strides : p.dv_strides;
    Element* out = static_cast<Element*>(which == 0 ? p.dk : p.dv) + batch * st.batch + kv_head * st.head;
    CUTE_UNROLL
    for (int g = 0; g < n / 4; ++g) {
      const float4 x = share[g * 128 + wg_tid];
      const float v[4] = {x.x, x.y, x.z, x.w};
      if constexpr (Traits::kSplitHead) {  // (H, keys): dKᵀ and dVᵀ, one element per store
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
          const int key = n_block * kBlockN + get<1>(coord(4 * g + j)), col = get<0>(coord(4 * g + j));
          if (key < p.S && col < p.H) out[int64_t(key) * st.row + col] = Element(v[j]);
        }
      } else {  // (keys, H): values (j, j + 1), j even, are columns (c, c + 1) of one key
        CUTE_UNROLL
        for (int j = 0; j < 4; j += 2) {
          const int key = n_block * kBlockN + get<0>(coord(4 * g + j)), col = get<1>(coord(4 * g + j));
          if (key < p.S && col < p.H) {
            cutlass::Array<Element, 2> pair;
            pair[0] = Element(v[j]);
            pair[1] = Element(v[j + 1]);
            *reinterpret_cast<cutlass::Array<Element, 2>*>(out + int64_t(key) * st.row + col) = pair;
          }
        }
      }
    }
  }
}

}  // namespace jfa::sm90
