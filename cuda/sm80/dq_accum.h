// The float32 dQ accumulator of the backward pass: how a query tile is stored and added to.
//
// Every key tile's CTA adds a [kBlockM, kHeadDim] partial dQ into the same query tile, so these
// adds are the backward's heaviest global traffic (kBlockM * kHeadDim floats per step). Stored
// row-major, a warp's m16n8 fragments touch 8 rows x 32 bytes per instruction. Instead each tile is
// a contiguous block stored in the order the threads hold the values ("fragment-major"): value i of
// thread t lives at (i / kVec) * kVec * kNThreads + t * kVec + i % kVec, so each warp instruction
// covers one contiguous 128 * kVec-byte span. The convert kernel reads it back with the same order.
//
// How the adds are done (per architecture of the compiled code, so writer and reader agree):
//   sm80+: kVec = 1, one coalesced scalar atomic (red.global.add.f32) per value.
//   sm90+: kVec = 4, 16-byte vector atomics (red.global.add.v4.f32), a quarter of the instructions.
// With the rotated step order of bwd_kernel.h the float4 atomics add as fast as a bulk reduction
// staged in smem (docs/performance.md, "Portable backward"), so the simpler atomics stay.
#pragma once

#include <cute/tensor.hpp>

#include "jfa/params.h"

namespace jfa::sm80 {

template <int kNThreads>
struct DqAccumOrder {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static constexpr int kVec = 4;
#else
  static constexpr int kVec = 1;
#endif
  __forceinline__ __device__ static int index(int i, int tidx) {
    return (i / kVec) * (kVec * kNThreads) + tidx * kVec + i % kVec;
  }
};

// First float of the tile holding query rows [m0, m0 + kBlockM) of (batch, head) in `lane`.
__forceinline__ __device__ float* dq_accum_tile(const AttentionParams& p, int lane, int64_t batch, int64_t head,
                                                int m0, int head_dim) {
  return p.dq_accum + (((lane * p.B + batch) * p.N + head) * p.dq_accum_rows() + m0) * head_dim;
}

// tile += acc (acc: this thread's dQ mma accumulator, any layout; only its value order matters).
template <int kNThreads, typename Acc>
__forceinline__ __device__ void dq_accum_add(float* tile, Acc const& acc, int tidx) {
  using Order = DqAccumOrder<kNThreads>;
  constexpr int n = decltype(size(acc))::value;
  static_assert(n % Order::kVec == 0);
  CUTE_UNROLL
  for (int i = 0; i < n; i += Order::kVec) {
    float* addr = tile + Order::index(i, tidx);
    if constexpr (Order::kVec == 4) {
      atomicAdd(reinterpret_cast<float4*>(addr), make_float4(acc(i), acc(i + 1), acc(i + 2), acc(i + 3)));
    } else {
      atomicAdd(addr, acc(i));
    }
  }
}

// Deterministic mode (the ordered plain/causal kernels, the general kernel when p.deterministic):
// key block n adds into lane n % kLanes of its dQ tiles (kLanes: kDqLanesOf below; a lane is a
// copy of the accumulator with semaphores of its own), and its adds into a tile wait for their
// turn, `turn` = the number of lower key blocks of the same lane that add into the same tile
// (the semaphore counts finished adds). The convert kernel sums the lanes in lane order, so
// dQ's rounding depends on the problem alone.
// CTAs are issued in increasing block index and a CTA only waits for lower key blocks, whose
// indices are lower too (bwd_kernel.h's grid order), so the wait cannot deadlock, whatever else
// runs on the GPU, and the order depends on the problem alone (not on the GPU's size).
// All CTAs walk the query tiles in the same order, so a CTA follows the next-lower key block's
// CTA of its lane a step behind; the ordered kernels take the semaphore read's and the fence's
// round trips off that critical path (split protocol below). Orders that follow the CTAs' arrival
// (rotated walks, higher key blocks first) were no faster and could deadlock unless the whole
// group is resident. Two lanes for the causal kernel only: its chains of one head end about a
// step apart, so a second lane halves the waiting; non-causal CTAs all run the same number of
// steps and lost with lanes (figures: docs/performance.md, "Backward: design measurements").
template <bool kCausal, bool kOrdered>
inline constexpr int kDqLanesOf = kCausal && kOrdered ? int(kDqLanes) : 1;
__forceinline__ __device__ int32_t* dq_semaphore(const AttentionParams& p, int lane, int64_t batch, int64_t head,
                                                 int m0) {
  return p.dq_semaphore + ((lane * p.B + batch) * p.N + head) * p.dq_semaphores_per_head() + m0 / kDqSemaphoreRows;
}

__forceinline__ __device__ void dq_wait_turn(int32_t* sem, int turn) {
  if (threadIdx.x == 0) {
    int v;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(sem) : "memory");
    } while (v != turn);
  }
  __syncthreads();
}

// The ordered kernels' split protocol, all by thread 0 (the kernel supplies the barriers):
//   peek: read the semaphore ahead of the add (relaxed: see below);
//   wait_turn_from: wait for the turn, starting from the value peeked;
//   release: publish the finished adds with a release store; a barrier after every thread's adds
//     comes before it, and the release is cumulative over what that barrier ordered before it.
//     A release store, not fence.acq_rel + a relaxed store: the fence's acquire half invalidates
//     the SM's L1 every step, sending the reloads of spilled registers and row statistics to L2,
//     and turns the dQ adds into ATOMG instead of REDG (docs/performance.md has the figures).
// The peek and the wait read relaxed, not acquire: an acquire read stalls its warp until the value
// arrives, which is the latency the early read hides. What the order needs still holds: this CTA
// issues its adds only after the branch on the value read (GPUs issue no memory operation past an
// unresolved branch), the adds are atomics performed in L2, and the previous CTA's were performed
// before its release became visible. (Formally, the PTX memory model ignores control
// dependencies; an acquire after the wait would cost the read's round trip again. What could go
// wrong is the order of the adds, never their sum: tests/cuda/sm80_check.cu and tests/test_gpu.py
// compare the bits of two runs, up to 8 key tiles per head.)
__forceinline__ __device__ int dq_semaphore_peek(const int32_t* sem) {
  int v;
  // No "memory" clobber: the read needs no order against this thread's other memory operations
  // (the barrier before the adds orders them), and a clobber would stop the compiler from
  // scheduling the gemms' shared-memory loads across it.
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(sem));
  return v;
}

__forceinline__ __device__ void dq_wait_turn_from(const int32_t* sem, int turn, int seen) {
  while (seen != turn) seen = dq_semaphore_peek(sem);
}

__forceinline__ __device__ void dq_semaphore_release(int32_t* sem, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(sem), "r"(value) : "memory");
}

__forceinline__ __device__ void dq_end_turn(int32_t* sem, int turn) {
  __threadfence();  // this thread's adds are visible before the next block's
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(sem), "r"(turn + 1) : "memory");
}

}  // namespace jfa::sm80
