// XLA FFI handlers of top-k sparse attention (forward, backward) and attn_dist on the CUDA platform:
// decode, check, enqueue the kernels of cuda/sparse/ on XLA's stream (nothing allocated: the
// backward's float32 scratch comes as extra results).
#include <cuda_runtime_api.h>

#include <string>

#include "ffi/decode_sparse.h"
#include "ffi/handlers.h"
#include "sparse/sparse_gpu.h"

namespace jfa {
namespace {

namespace ffi = xla::ffi;
using ffi_decode::SparseAttrs;

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

ffi::Error SparseForwardCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::AnyBuffer indices, ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                             float scale, int32_t is_causal, int32_t bottom_right, int64_t value_head_dim) {
  SparseParams p;
  const SparseAttrs attrs{scale, is_causal, bottom_right};
  if (auto e = ffi_decode::decode_sparse_forward(q, k, v, indices, *o, *lse, attrs, value_head_dim, &p); e.failure())
    return e;
  if (auto e = check_head_dims(p); e.failure()) return e;
  return launched(sparse_gpu::forward(p, stream), "sparse attention forward");
}

ffi::Error SparseBackwardCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::AnyBuffer indices, ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                              ffi::AnyBuffer dlse, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                              ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dk_accum,
                              ffi::Result<ffi::AnyBuffer> dv_accum, ffi::Result<ffi::AnyBuffer> softmax_d,
                              float scale, int32_t is_causal, int32_t bottom_right, int64_t value_head_dim,
                              int32_t deterministic) {
  SparseParams p;
  const SparseAttrs attrs{scale, is_causal, bottom_right};
  if (auto e = ffi_decode::decode_sparse_backward(q, k, v, indices, o, lse, dout, dlse, *dq, *dk, *dv, attrs,
                                                  value_head_dim, &p);
      e.failure())
    return e;
  if (auto e = check_head_dims(p); e.failure()) return e;
  if (auto e = ffi_decode::expect(*dk_accum, "dk workspace", {p.B, p.S, p.K, p.H}, ffi::DataType::F32); e.failure())
    return e;
  if (p.v) {
    if (auto e = ffi_decode::expect(*dv_accum, "dv workspace", {p.B, p.S, p.K, p.Hv}, ffi::DataType::F32);
        e.failure())
      return e;
  }
  if (auto e = ffi_decode::expect(*softmax_d, "softmax_d workspace", {p.B, p.T, p.N}, ffi::DataType::F32);
      e.failure())
    return e;
  p.deterministic = deterministic != 0;
  sparse_gpu::SparseBackwardWorkspace ws;
  ws.dk_accum = static_cast<float*>(dk_accum->untyped_data());
  ws.dv_accum = p.v ? static_cast<float*>(dv_accum->untyped_data()) : nullptr;
  ws.softmax_d = static_cast<float*>(softmax_d->untyped_data());
  return launched(sparse_gpu::backward(p, ws, stream), "sparse attention backward");
}

ffi::Error AttnDistCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer indices,
                        ffi::AnyBuffer lse, ffi::Result<ffi::AnyBuffer> dist, float scale, int32_t is_causal,
                        int32_t bottom_right, int64_t head_group) {
  SparseParams p;
  const SparseAttrs attrs{scale, is_causal, bottom_right};
  if (auto e = ffi_decode::decode_attn_dist(q, k, indices, lse, *dist, attrs, head_group, &p); e.failure()) return e;
  if (auto e = check_head_dims(p); e.failure()) return e;
  return launched(sparse_gpu::attn_dist(p, stream), "attn_dist");
}

}  // namespace
}  // namespace jfa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaSparseForwardCuda, jfa::SparseForwardCuda,
    xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
      .Arg<xla::ffi::AnyBuffer>()  // q [B, T, N, H]
      .Arg<xla::ffi::AnyBuffer>()  // k [B, S, K, H]
      .Arg<xla::ffi::AnyBuffer>()  // v [B, S, K, Hv], or rank 0: V = k[..., :value_head_dim]
      .Arg<xla::ffi::AnyBuffer>()  // indices int32 [B, T, K, topk]
      .Ret<xla::ffi::AnyBuffer>()  // o [B, T, N, Hv]
      .Ret<xla::ffi::AnyBuffer>()  // lse float32 [B, T, N]
      .Attr<float>("scale")
      .Attr<int32_t>("is_causal")
      .Attr<int32_t>("bottom_right")
      .Attr<int64_t>("value_head_dim"),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaSparseBackwardCuda, jfa::SparseBackwardCuda,
    xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
      .Arg<xla::ffi::AnyBuffer>()  // q
      .Arg<xla::ffi::AnyBuffer>()  // k
      .Arg<xla::ffi::AnyBuffer>()  // v, or rank 0
      .Arg<xla::ffi::AnyBuffer>()  // indices
      .Arg<xla::ffi::AnyBuffer>()  // o
      .Arg<xla::ffi::AnyBuffer>()  // lse
      .Arg<xla::ffi::AnyBuffer>()  // dout
      .Arg<xla::ffi::AnyBuffer>()  // dlse
      .Ret<xla::ffi::AnyBuffer>()  // dq
      .Ret<xla::ffi::AnyBuffer>()  // dk (with v rank 0: dK + dV in one buffer)
      .Ret<xla::ffi::AnyBuffer>()  // dv, or rank 0
      .Ret<xla::ffi::AnyBuffer>()  // workspace: float32 dK accumulator [B, S, K, H]
      .Ret<xla::ffi::AnyBuffer>()  // workspace: float32 dV accumulator [B, S, K, Hv], or rank 0
      .Ret<xla::ffi::AnyBuffer>()  // workspace: float32 D = rowsum(dO∘O) − dLSE [B, T, N]
      .Attr<float>("scale")
      .Attr<int32_t>("is_causal")
      .Attr<int32_t>("bottom_right")
      .Attr<int64_t>("value_head_dim")
      .Attr<int32_t>("deterministic"),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaAttnDistCuda, jfa::AttnDistCuda,
    xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
      .Arg<xla::ffi::AnyBuffer>()  // q
      .Arg<xla::ffi::AnyBuffer>()  // k
      .Arg<xla::ffi::AnyBuffer>()  // indices
      .Arg<xla::ffi::AnyBuffer>()  // lse float32 [B, T, N], natural log
      .Ret<xla::ffi::AnyBuffer>()  // dist float32 [B, N / head_group, T, topk]
      .Attr<float>("scale")
      .Attr<int32_t>("is_causal")
      .Attr<int32_t>("bottom_right")
      .Attr<int64_t>("head_group"),
    {xla::ffi::Traits::kCmdBufferCompatible});
