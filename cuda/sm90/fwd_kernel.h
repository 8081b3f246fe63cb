// Forward kernel for Hopper (sm90a): TMA loads, wgmma, warp specialization, persistent tiles.
//
// Roles. Warpgroup 0 is the producer: its warp 0 issues TMA loads of each tile's Q (once) and of K
// and V through a kStages-deep smem ring (fwd_producer.h); it lowers its registers with setmaxnreg
// so that the consumers can raise theirs. Warpgroups 1..kNumMmaWarpGroups are consumers, each
// owning 64 query rows of the tile (fwd_mainloop.h; one whose rows all lie past T only passes the
// tile's stages on), each storing its own rows of O and its LSE (fwd_epilogue.h). Tiles come from
// the persistent scheduler (tile_scheduler.h); the producer works out each next tile and hands it
// to the consumers at their tile meetings.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "fwd_mainloop.h"
#include "fwd_params.h"
#include "fwd_producer.h"
#include "fwd_traits.h"
#include "mask_policies.h"
#include "tile_scheduler.h"

namespace jfa::sm90 {

using namespace cute;

template <typename Traits, bool kCausal, int kPolicies>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    fwd_kernel(CUTE_GRID_CONSTANT FwdParams<Traits> const p, TileScheduler<kCausal || kPolicies != 0> const sched) {
  constexpr bool kAlibiPrefix = alibi_on_tensor_cores(kPolicies);
  static_assert(!kAlibiPrefix || Traits::kBlockN <= 256, "the prefix's key columns must be exact in bf16");
  static_assert(!(kCausal && kPolicies != 0), "the general path takes causality from p.attn");
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  constexpr int kBlockN = Traits::kBlockN, kPrefixK = Traits::kPrefixK;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<FwdSharedStorage<Traits, kAlibiPrefix>*>(smem_raw);
  const int warp_group = cutlass::canonical_warp_group_idx();

  if (threadIdx.x == 0) {
    ss.q_full.init(1);
    // Aliased O: each consumer warpgroup's storing thread, once its store has read smem.
    ss.q_empty.init(Traits::kOAliasesQ ? Traits::kNumMmaWarpGroups : Traits::kNumMmaThreads);
  }
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Traits::kKVStageBytes;
  pipe_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kNumMmaThreads;
  Pipeline pipeline_k(ss.pipeline_k, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_v(ss.pipeline_v, pipe_params, Shape<_1, _1, _1>{});
  // ALiBi's k prefix, the keys' side: every block's, (c, c, c, 0, ...) for column c.
  if constexpr (kAlibiPrefix) {
    Tensor sKPrefix = make_tensor(make_smem_ptr(ss.prefix.k.data()), typename Traits::SmemLayoutKPrefix{});
    for (int i = threadIdx.x; i < kBlockN * kPrefixK; i += Traits::kNumThreads)
      sKPrefix(i / kPrefixK, i % kPrefixK) = Element(i % kPrefixK < 3 ? float(i / kPrefixK) : 0.f);
    cutlass::arch::fence_view_async_shared();  // visible to wgmma (the async proxy) after the barrier
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kLoadRegs>();
    if (threadIdx.x < 32) fwd_produce<Traits, kCausal, kPolicies>(p, sched, ss, pipeline_k, pipeline_v);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegs>();
  fwd_consume<Traits, kCausal, kPolicies>(p, sched, ss, pipeline_k, pipeline_v);
}

}  // namespace jfa::sm90
