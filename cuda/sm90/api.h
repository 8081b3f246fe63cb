// Host entry points of the Hopper (sm90a) kernels: TMA + wgmma + warp specialization.
//
// Host-only: includable from a .cc compiled by a plain C++ compiler. The forward takes every mask
// and dropout; the backward takes plain and top-left causal calls (the others run on the portable
// kernels, sm80/api.h). Both kernels' LSE is the portable ones' (float32, natural log, [B,T,N]
// through lse_strides), so either backward follows either forward. Both functions only enqueue
// work on `stream` (no allocation, no synchronization: CUDA-graph safe); call them only on a device
// of compute capability 9.0.
#pragma once

#include <cuda_runtime_api.h>

#include "jfa/params.h"
#include "jfa/sparse_params.h"

namespace jfa::sm90 {

// Whether this build contains the kernels for (dtype, head_dim).
bool is_built(DType dtype, int head_dim);

// The head dim of the built kernel that runs head_dim, or -1: head_dim's own, else the next
// larger one (H 32 on the H 64 kernel, 96 on 128, 192 on 256; each measured faster there than on
// the portable kernel of its own width, docs/performance.md). Tensor maps keep the call's width:
// TMA fills the missing columns of Q, K, V and dO with zeros, which change no score, and clips the
// stores of O, dK and dV to it.
int kernel_head_dim(DType dtype, int head_dim);

// Columns of a row of the backward's float32 workspace (AttentionParams::accum_cols) that let
// any built dtype of head_dim run here: the kernel's width where it is wider than head_dim.
int workspace_head_dim(int head_dim);

// A paged call's page size must be a multiple of this: the producer loads a key tile that spans
// several pages in chunks of this many rows (or wider ones where the page size allows), each
// inside one page (paged_kv.h); a tile inside one page goes as one copy.
constexpr int kPagedPageRows = 16;

// Whether forward() takes this call: a kernel for its head dim (kernel_head_dim; H a multiple of
// 8), H == Hv, T, S >= 1, and what TMA needs
// (16-byte aligned base pointers and row/head/batch strides, sizes below 2^31); a paged cache
// (AttentionParams::paged) with pages of a multiple of kPagedPageRows rows. Calls it rejects go to
// the portable kernel, which takes no paged cache.
bool can_implement(const AttentionParams& p);

// Writes p.o and p.lse (float32, natural log). cudaErrorNotSupported where !can_implement(p).
cudaError_t forward(const AttentionParams& p, cudaStream_t stream);

// Whether backward() takes this call: a kernel for its head dim, with workspace rows as wide as
// that kernel (p.accum_cols), any mask, score
// modifier and dropout (the general path, bwd_general.h), deterministic=True with p.dq_semaphore
// (bwd_dq_order.h), and what TMA needs of q, k, v, dout, dk and dv (as can_implement).
bool can_implement_backward(const AttentionParams& p);

// Writes p.dq, p.dk, p.dv. Workspace: p.dq_accum (kDqLanes lanes with deterministic=True, else one),
// p.softmax_d and p.lse_log2 (params.h);
// p.dlse may be null. cudaErrorNotSupported where !can_implement_backward(p).
cudaError_t backward(const AttentionParams& p, cudaStream_t stream);

// Top-k sparse attention (jax_flashattn.sparse_attention) forward on wgmma, sparse_fwd_kernel.h:
// whether it takes the call (float16/bfloat16, MLA's shape H 576 with V the first Hv = 512
// columns of the key rows, query heads per key head a multiple of 64, 16-byte aligned q, k, o),
// and the launch, which writes p.o and p.lse (cudaErrorNotSupported, nothing launched, for calls
// it does not take or a device without the shared memory it needs). Other calls run on
// cuda/sparse's kernels.
bool can_implement_sparse_forward(const SparseParams& p);
cudaError_t sparse_forward(const SparseParams& p, cudaStream_t stream);

// First pass of the top-k sparse backward on wgmma, sparse_bwd_kernel.h: whether it takes the call
// (the forward's shapes, deterministic=False, 16-byte aligned dout and dq), and the launch for the
// (query position, key head) items [first_item, first_item + count): their rows of p.dq, and their
// P and scale·dS into `weights` ([count, 2, N / K, weight_row_slots(topk)]), with D read from
// softmax_d ([B, T, N]); the second pass (sparse_key_rows below, or cuda/sparse's) turns the
// weights into dK and dV (sparse_gpu::backward's first pass). cudaErrorNotSupported, nothing
// launched, for calls it does not take or a device without the shared memory it needs.
bool can_implement_sparse_backward_weights(const SparseParams& p);
cudaError_t sparse_backward_weights(const SparseParams& p, const float* softmax_d, void* weights, int64_t first_item,
                                    int64_t count, cudaStream_t stream);

// Second pass of the top-k sparse backward on wgmma, sparse_key_rows_kernel.h: whether it takes
// the call (the first pass's shapes: V inside K, float16/bfloat16, 16-byte aligned dout), and the
// launch for the items [first_item, first_item + count): dK + dV of their selected rows added into
// `accum` ([B, S, K, 576] float32) from the chunk's `weights` as the first pass wrote them
// (sparse_gpu::backward's second pass). cudaErrorNotSupported, nothing launched, for calls it does
// not take, unaligned buffers or a device without the shared memory it needs.
bool can_implement_sparse_key_rows(const SparseParams& p);
cudaError_t sparse_key_rows(const SparseParams& p, const void* weights, float* accum, int64_t first_item,
                            int64_t count, cudaStream_t stream);

// attn_dist (jax_flashattn.attn_dist) on wgmma, sparse_dist_kernel.h: whether it takes the call
// (the forward's shapes without a value operand: float16/bfloat16, H 576, query heads per key head
// a multiple of 64, head_group 64 or 128, 16-byte aligned q and k), and the launch, which zeroes
// and writes p.dist (cudaErrorNotSupported, nothing written, for calls it does not take).
bool can_implement_attn_dist(const SparseParams& p);
cudaError_t attn_dist(const SparseParams& p, cudaStream_t stream);

}  // namespace jfa::sm90
