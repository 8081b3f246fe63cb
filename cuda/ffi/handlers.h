// The FFI handler symbols this extension exports, per platform: each handler's target name (the
// key jax_flashattn/_ext.py looks up) and symbol stem, written once for declaration and module.cc.
#pragma once

#include <cstdint>

#include "jfa/params.h"
#include "xla/ffi/api/ffi.h"

// X(target, stem): the handler is symbol stem##Cpu on the CPU and stem##Cuda on the GPU.
#define JFA_HANDLERS(X)                                                                      \
  X("jfa_attention_fwd", JfaForward) X("jfa_attention_bwd", JfaBackward)                     \
  X("jfa_pack_mask", JfaPackMask) X("jfa_sparse_fwd", JfaSparseForward)                      \
  X("jfa_sparse_bwd", JfaSparseBackward) X("jfa_attn_dist", JfaAttnDist)

#define JFA_DECLARE_CPU_HANDLER(target, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(stem##Cpu);
JFA_HANDLERS(JFA_DECLARE_CPU_HANDLER)

#ifdef JFA_WITH_CUDA
#define JFA_DECLARE_CUDA_HANDLER(target, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(stem##Cuda);
JFA_HANDLERS(JFA_DECLARE_CUDA_HANDLER)

namespace jfa {
// Columns of a row of the CUDA backward's float32 workspace (dq_accum, dkv_accum) for head dim H:
// H, or the width of the Hopper kernel that runs H where that is wider (sm90/api.h). The lowering
// allocates the workspace with it (module.cc exports it) and the handler checks it.
int64_t cuda_accum_cols(int64_t H);
// The page sizes (multiples of the result) whose paged caches the Hopper forward reads in place at
// head dim H, or 0 where no Hopper kernel runs H (module.cc exports it; the CUDA forward handler
// refuses the other paged calls).
int64_t cuda_paged_page_rows(int64_t H);
// Whether the sparse backward's tensor-core kernels take a deterministic=False call of this dtype,
// head counts, head dims and topk on the current device (its shared memory sizes the tiles); with
// shares_values, V is K's first Hv columns. module.cc exports it: the lowering picks XLA's backward
// for the calls they do not take (sparse_cuda.cc).
bool cuda_sparse_backward_tensor_cores(DType dtype, int64_t N, int64_t K, int64_t H, int64_t Hv, int64_t topk,
                                       bool shares_values);
#ifdef JFA_HAS_SM90
// Whether calls may run on the Hopper kernels: a compute capability 9.0 device, and
// JFA_FORCE_SM80 not 1 (cuda_handlers.cc).
bool hopper_allowed();
#endif
}  // namespace jfa
#endif
