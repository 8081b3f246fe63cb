// XLA FFI handlers of top-k sparse attention (forward, backward) and attn_dist on the CUDA platform:
// decode, check, enqueue on XLA's stream the Hopper kernels (cuda/sm90/sparse_*) for the calls
// they take, else those of cuda/sparse/ (nothing allocated: the backward's float32 scratch comes
// as extra results).
#include <cuda_runtime_api.h>

#include <string>

#include "ffi/decode_sparse.h"
#include "ffi/handlers.h"
#include "ffi/sparse_call.h"
#include "sparse/sparse_gpu.h"
#ifdef JFA_HAS_SM90
#include "sm90/api.h"
#endif

namespace jfa {
namespace {

namespace ffi = xla::ffi;

// The backward's workspace: dk_accum float32 [B, S, K, H], dv_accum float32 [B, S, K, Hv] (or rank
// 0 with v), softmax_d float32 [B, T, N], D = rowsum(dO∘O) − dLSE, and weights [items, 2, N / K,
// weight_row_slots(topk)] in q's dtype: P and scale·dS of `items` (query position, key head) items
// at a time for the tensor-core kernels (items 0: those kernels do not run).
#define JFA_SPARSE_BACKWARD_CUDA(ARG, RET, ATTR)                                                  \
  JFA_SPARSE_BACKWARD_OPERANDS(ARG) JFA_SPARSE_BACKWARD_RESULTS(RET) RET(dk_accum) RET(dv_accum) \
  RET(softmax_d) RET(weights) JFA_SPARSE_ATTRS(ATTR) ATTR(int64_t, value_head_dim) ATTR(int32_t, deterministic)

struct SparseForwardCall {
  cudaStream_t stream;
  JFA_FFI_CALL_FIELDS(JFA_SPARSE_FORWARD)
};
struct SparseBackwardCall {
  cudaStream_t stream;
  JFA_FFI_CALL_FIELDS(JFA_SPARSE_BACKWARD_CUDA)
};
struct AttnDistCall {
  cudaStream_t stream;
  JFA_FFI_CALL_FIELDS(JFA_ATTN_DIST)
};

ffi::Error check_head_dims(const SparseParams& p) {
  if (p.H > sparse_gpu::kMaxHeadDim || p.Hv > sparse_gpu::kMaxHeadDim)
    return ffi_decode::invalid("sparse attention: the CUDA kernels take head dims up to " +
                               std::to_string(sparse_gpu::kMaxHeadDim) + ", got H=" + std::to_string(p.H) +
                               ", Hv=" + std::to_string(p.Hv));
  return ffi::Error::Success();
}

ffi::Error launched(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_flashattn: ") + what + " kernel launch failed: " +
                              cudaGetErrorString(err));
}

ffi::Error SparseForwardCuda(SparseForwardCall c) {
  SparseParams p;
  if (auto e = ffi_decode::decode_sparse_forward_call(c, &p); e.failure()) return e;
  if (auto e = check_head_dims(p); e.failure()) return e;
#ifdef JFA_HAS_SM90
  // A Hopper device without the kernel's shared memory (none known) falls through.
  if (hopper_allowed() && sm90::can_implement_sparse_forward(p)) {
    const cudaError_t e = sm90::sparse_forward(p, c.stream);
    if (e != cudaErrorNotSupported) return launched(e, "sparse attention forward (Hopper)");
  }
#endif
  return launched(sparse_gpu::forward(p, c.stream), "sparse attention forward");
}

ffi::Error SparseBackwardCuda(SparseBackwardCall c) {
  SparseParams p;
  if (auto e = ffi_decode::decode_sparse_backward_call(c, &p); e.failure()) return e;
  if (auto e = check_head_dims(p); e.failure()) return e;
  if (auto e = ffi_decode::expect(*c.dk_accum, "dk workspace", {p.B, p.S, p.K, p.H}, ffi::DataType::F32); e.failure())
    return e;
  if (p.v) {
    if (auto e = ffi_decode::expect(*c.dv_accum, "dv workspace", {p.B, p.S, p.K, p.Hv}, ffi::DataType::F32);
        e.failure())
      return e;
  }
  if (auto e = ffi_decode::expect(*c.softmax_d, "softmax_d workspace", {p.B, p.T, p.N}, ffi::DataType::F32);
      e.failure())
    return e;
  const auto wd = c.weights->dimensions();
  const int64_t group = p.N / p.K, slots = sparse_gpu::weight_row_slots(p.topk);
  if (wd.size() != 4 || wd[0] < 0 || wd[1] != 2 || wd[2] != group || wd[3] != slots ||
      c.weights->element_type() != c.q.element_type())
    return ffi_decode::invalid("weights workspace must have shape (items, 2, " + std::to_string(group) + ", " +
                               std::to_string(slots) + ") and the query's dtype, got " +
                               ffi_decode::shape_str(wd));
  p.deterministic = c.deterministic != 0;
  sparse_gpu::SparseBackwardWorkspace ws;
  ws.weights = c.weights->untyped_data();
  ws.weight_items = wd[0];
  ws.dk_accum = static_cast<float*>(c.dk_accum->untyped_data());
  ws.dv_accum = p.v ? static_cast<float*>(c.dv_accum->untyped_data()) : nullptr;
  ws.softmax_d = static_cast<float*>(c.softmax_d->untyped_data());
  sparse_gpu::BackwardPasses passes;
#ifdef JFA_HAS_SM90
  if (hopper_allowed() && sm90::can_implement_sparse_backward_weights(p)) passes.first = sm90::sparse_backward_weights;
  if (hopper_allowed() && sm90::can_implement_sparse_key_rows(p)) passes.second = sm90::sparse_key_rows;
#endif
  return launched(sparse_gpu::backward(p, ws, c.stream, sparse_gpu::BackwardKernels::kAuto, passes),
                  "sparse attention backward");
}

ffi::Error AttnDistCuda(AttnDistCall c) {
  SparseParams p;
  if (auto e = ffi_decode::decode_attn_dist_call(c, &p); e.failure()) return e;
  if (auto e = check_head_dims(p); e.failure()) return e;
#ifdef JFA_HAS_SM90
  if (hopper_allowed() && sm90::can_implement_attn_dist(p)) {
    const cudaError_t e = sm90::attn_dist(p, c.stream);
    if (e != cudaErrorNotSupported) return launched(e, "attn_dist (Hopper)");
  }
#endif
  return launched(sparse_gpu::attn_dist(p, c.stream), "attn_dist");
}

}  // namespace

bool cuda_sparse_backward_tensor_cores(DType dtype, int64_t N, int64_t K, int64_t H, int64_t Hv, int64_t topk,
                                       bool shares_values) {
  SparseParams p;
  p.dtype = dtype;
  p.B = p.T = p.S = 1;
  p.N = N;
  p.K = K;
  p.H = H;
  p.Hv = Hv;
  p.topk = topk;
  // Only null-ness is read: whether V is K's first columns, which sizes the tiles.
  static const char kSomeValues = 0;
  p.v = shares_values ? nullptr : &kSomeValues;
  if (K < 1 || N % K != 0 || check_head_dims(p).failure()) return false;
  sparse_gpu::SparseBackwardWorkspace ws;
  static char kSomeWeights = 0;
  ws.weights = &kSomeWeights;
  ws.weight_items = 1;
  return sparse_gpu::backward_tensor_cores_takes(p, ws);
}

}  // namespace jfa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaSparseForwardCuda,
                              jfa::ffi_call::packed<jfa::SparseForwardCall>(jfa::SparseForwardCuda),
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  JFA_FFI_BIND(JFA_SPARSE_FORWARD),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaSparseBackwardCuda,
                              jfa::ffi_call::packed<jfa::SparseBackwardCall>(jfa::SparseBackwardCuda),
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  JFA_FFI_BIND(JFA_SPARSE_BACKWARD_CUDA),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaAttnDistCuda, jfa::ffi_call::packed<jfa::AttnDistCall>(jfa::AttnDistCuda),
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  JFA_FFI_BIND(JFA_ATTN_DIST),
                              {xla::ffi::Traits::kCmdBufferCompatible});
