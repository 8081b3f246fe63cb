// deterministic=True on the Hopper backward: every query block's dQ partial sums are added in
// increasing key-block order, so the float32 accumulator, and dQ, are the same bits on every run.
//
// With kLanes copies ("lanes") of the accumulator (params.h: up to kDqLanes; bwd_dq_lanes below),
// key block n_block adds into lane n_block % kLanes, whose chain of turns holds every kLanes-th key
// block only: a CTA waits for the one kLanes key blocks below it, which started that much earlier,
// rather than for the one just below; the conversion (bwd_postprocess.h) adds the lanes up in a
// fixed order. A semaphore per (lane, batch, query head, kDqSemaphoreRows query rows) counts the
// key blocks of its lane that have added into the block (zeroed by the launcher). Key block
// n_block's turn at query block m_block is the number of lower key blocks of its lane that add
// there (bwd_dq_turn); the adder waits until the count reaches it, adds, and once the adds are
// complete increments the count with a release. A CTA only ever waits for CTAs of lower key blocks
// of its (batch, K/V head), which every tile order launches first (tile_scheduler.h: n-block-minor,
// or n-block rank-major within a section), so they are resident or done: no wait can deadlock.
#pragma once

#include <cstdint>

#include "bwd_general.h"
#include "jfa/params.h"

namespace jfa::sm90 {

// The lane key block n_block adds into: 0 unless deterministic=True.
template <int kLanes>
__forceinline__ __device__ int bwd_dq_lane(const AttentionParams& p, int n_block) {
  static_assert(kLanes >= 1 && kLanes <= kDqLanes);
  return p.deterministic ? n_block % kLanes : 0;
}

// The semaphore of query block m_block (kBlockM rows) of (batch, head) in lane `lane`: for a
// multiple of kDqSemaphoreRows the first of its rows' (the portable kernels' layout, params.h); for
// taller blocks (80 rows) the m_block-th, of which (batch, head) has at least as many.
template <int kBlockM>
__forceinline__ __device__ int32_t* bwd_dq_semaphore(const AttentionParams& p, int lane, int batch, int head,
                                                     int m_block) {
  static_assert(kBlockM % kDqSemaphoreRows == 0 || kBlockM > kDqSemaphoreRows);
  constexpr int kPerBlock = kBlockM % kDqSemaphoreRows == 0 ? int(kBlockM / kDqSemaphoreRows) : 1;
  return p.dq_semaphore + ((int64_t(lane) * p.B + batch) * p.N + head) * p.dq_semaphores_per_head() +
         int64_t(m_block) * kPerBlock;
}

// How many key blocks below n_block in its dQ lane add into query block m_block: all of them on
// the plain path (every key block walks every query block; top-left causal: a lower key block's
// walk starts no later and ends at the last block), else those whose walk (bwd_general_m_blocks)
// holds m_block, counted by the 32 threads of the calling warp together.
template <int kBlockM, int kBlockN, int kPolicies, int kLanes>
__forceinline__ __device__ int bwd_dq_turn(const AttentionParams& p, int batch, int kv_head, int n_block, int m_block) {
  if constexpr (kPolicies == 0) {
    return n_block / kLanes;
  } else {
    const int thread = threadIdx.x % 32;
    int turn = 0;
    for (int base = 0; base < n_block; base += 32) {
      const int other = base + thread;
      bool adds = false;
      if (other < n_block && other % kLanes == n_block % kLanes) {
        const int2 r = bwd_general_m_blocks<kBlockM, kBlockN, kPolicies>(p, batch, kv_head, other);
        adds = m_block >= r.x && m_block < r.y;
      }
      turn += __popc(__ballot_sync(0xffffffffu, adds));
    }
    return turn;
  }
}

// The lanes a kernel adds into with deterministic=True: the traits' (kDeterministicDqLanes) on the
// plain path and in the split-head layout; one on the general path of the writer warp's layout,
// whose H 64 kernels, short of registers, spilled more with two (docs/performance.md).
template <typename Traits, int kPolicies>
__forceinline__ __host__ __device__ constexpr int bwd_dq_lanes() {
  return kPolicies == 0 || Traits::kSplitHead ? Traits::kDeterministicDqLanes : 1;
}

// The threads of the split-head layout's meetings around a step's ordered adds: the MMA threads
// and the turn keeper warp (bwd_producer.h, bwd_keep_dq_turns).
template <typename Traits>
inline constexpr int kBwdDqTurnThreads = Traits::kNumMmaThreads + 32;

// Whether a split-head kernel's turns are kept by the turn keeper warp: on the plain path. The
// general path's turn count (bwd_dq_turn over the masks' walks) in the producer's few registers
// spilled, and the spills cost those kernels' default backward too (docs/performance.md), so
// there the MMA threads keep waiting for their turns themselves, as before the keeper.
template <typename Traits, int kPolicies>
__forceinline__ __host__ __device__ constexpr bool bwd_keeps_dq_turns() {
  return Traits::kSplitHead && kPolicies == 0;
}

__forceinline__ __device__ void bwd_dq_wait_turn(const int32_t* semaphore, int turn) {
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(semaphore) : "memory");
  } while (seen != turn);
}

// Passes the turn on, after this thread's adds are complete (its bulk reductions waited for) or
// after the adding threads arrived at a barrier this thread has since waited at: a release orders
// both before it (the PTX memory model's release is cumulative). No fence before it: a
// sequentially consistent one (__threadfence) orders nothing more here, and every step waited
// for it (docs/performance.md, Hopper backward).
__forceinline__ __device__ void bwd_dq_pass_turn(int32_t* semaphore) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(semaphore) : "memory");
}

// The same behind a fence: the general path's split-head kernels, whose code is kept as it was
// measured (a change there moves their register allocation, which their default backward pays).
__forceinline__ __device__ void bwd_dq_fence_and_pass_turn(int32_t* semaphore) {
  __threadfence();
  bwd_dq_pass_turn(semaphore);
}

}  // namespace jfa::sm90
