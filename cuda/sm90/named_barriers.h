// Named barriers (bar.sync / bar.arrive with an id and a thread count) of the Hopper kernels, and
// the ids each kernel gives them. Id 0 is __syncthreads'; the kernels use no CUTLASS collective, so
// CUTLASS's reserved ids are free. A hardware barrier counts threads per id, so two kernels may
// reuse ids: only the ids inside one kernel must be distinct.
#pragma once

namespace jfa::sm90 {

__forceinline__ __device__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__forceinline__ __device__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// The unaligned form, for warps whose lanes may arrive diverged (each spinning on an mbarrier on
// its own), which bar.sync's aligned form does not allow (synccheck reports it).
__forceinline__ __device__ void bar_sync_unaligned(int id, int threads) {
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Forward (fwd_mainloop.h), per consumer warpgroup w: its ping-pong scheduler barrier, its tile
// meeting with the producer warp and its own meetings, the epilogue's and paged_kv.h's (ids
// first + w). Per warpgroup, so that nothing but the ping-pong order ties the consumers together:
// a warpgroup ending a tile stores its own rows of O and starts the next tile while the other
// still runs its last P·V.
enum : int { kFwdBarSchedFirst = 1, kFwdBarTileFirst = 4, kFwdBarEpilogueFirst = 7 };
// A scheduler barrier joins two warpgroups, whatever their number: the one that waits there for its
// turn and the one before it, which arrives when it has issued its GEMMs.
inline constexpr int kFwdSchedBarThreads = 2 * 128;

// The forward's tile meeting of the producer warp and consumer warpgroup w, once per tile (and
// once more at the end): the producer reaches it once it has issued the tile's first loads, and
// writes the next tile's TileWork after it (tile_scheduler.h, publish_work); the consumers read
// that after the next meeting. Unaligned: the producer lanes arrive diverged.
__forceinline__ __device__ void fwd_tile_meeting(int w) { bar_sync_unaligned(kFwdBarTileFirst + w, 128 + 32); }

// Backward (bwd_kernel.h): dS of a step complete in smem (all MMA threads); per MMA warpgroup w,
// its dQ smem slice full (it and the dQ writer warp) and empty again (the same), and its epilogue;
// and the MMA threads' meeting before the epilogue reuses the Q and dO buffers; with
// deterministic=True in the split-head layout, the turn keeper warp's two meetings with the MMA
// threads per step (bwd_keep_dq_turns): the step's turn has come, and the step's dQ adds are issued.
enum : int {
  kBwdBarDsReady = 1, kBwdBarDqFullFirst = 2, kBwdBarDqEmptyFirst = 4, kBwdBarEpilogueFirst = 6,
  kBwdBarMainloopDone = 8, kBwdBarDqTurn = 9, kBwdBarDqAdded = 10
};

// Top-k sparse forward (sparse_fwd_kernel.h), between its two consumer warpgroups: warpgroup 0
// published its running max, warpgroup 1 the joint one; each one's P is in shared memory; both
// softmax sums are; within warpgroup w (kSparseBarStagedFirst + w), its half of O is staged in shared
// memory.
enum : int {
  kSparseBarMax0 = 1, kSparseBarMax1 = 2, kSparseBarP0 = 3, kSparseBarP1 = 4, kSparseBarSums = 5,
  kSparseBarStagedFirst = 6
};

// Top-k sparse backward's first pass (sparse_bwd_kernel.h), between its two consumer warpgroups:
// warpgroup 1's dP of a block is in shared memory; warpgroup 0's scale·dS is.
enum : int { kSparseBwdBarDpReady = 1, kSparseBwdBarDsReady = 2 };

// Top-k sparse backward's second pass (sparse_key_rows_kernel.h): within consumer warpgroup c, the
// staged rows are free again (the last block's bulk reductions have read them), then written.
enum : int { kSparseKeyRowsBarStagedFirst = 1 };

// Top-k attn_dist (sparse_dist_kernel.h): within consumer warpgroup w, its warps' column sums of a
// block are in shared memory.
enum : int { kSparseDistBarSumsFirst = 1 };

}  // namespace jfa::sm90
