// XLA FFI handlers of top-k sparse attention (forward, backward) and attn_dist on the CPU platform.
#include "cpu/sparse_attention.h"
#include "ffi/decode_sparse.h"
#include "ffi/handlers.h"

namespace jfa {
namespace {

namespace ffi = xla::ffi;
using ffi_decode::SparseAttrs;

ffi::Error SparseForwardCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer indices,
                            ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, float scale,
                            int32_t is_causal, int32_t bottom_right, int64_t value_head_dim) {
  SparseParams p;
  const SparseAttrs attrs{scale, is_causal, bottom_right};
  if (auto e = ffi_decode::decode_sparse_forward(q, k, v, indices, *o, *lse, attrs, value_head_dim, &p); e.failure())
    return e;
  cpu::sparse_forward(p);
  return ffi::Error::Success();
}

ffi::Error SparseBackwardCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer indices,
                             ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                             ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                             ffi::Result<ffi::AnyBuffer> dv, float scale, int32_t is_causal, int32_t bottom_right,
                             int64_t value_head_dim, int32_t deterministic) {
  SparseParams p;
  const SparseAttrs attrs{scale, is_causal, bottom_right};
  if (auto e = ffi_decode::decode_sparse_backward(q, k, v, indices, o, lse, dout, dlse, *dq, *dk, *dv, attrs,
                                                  value_head_dim, &p);
      e.failure())
    return e;
  p.deterministic = deterministic != 0;  // the CPU backward is always deterministic
  cpu::sparse_backward(p);
  return ffi::Error::Success();
}

ffi::Error AttnDistCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer indices, ffi::AnyBuffer lse,
                       ffi::Result<ffi::AnyBuffer> dist, float scale, int32_t is_causal, int32_t bottom_right,
                       int64_t head_group) {
  SparseParams p;
  const SparseAttrs attrs{scale, is_causal, bottom_right};
  if (auto e = ffi_decode::decode_attn_dist(q, k, indices, lse, *dist, attrs, head_group, &p); e.failure()) return e;
  cpu::attn_dist(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jfa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaSparseForwardCpu, jfa::SparseForwardCpu,
    xla::ffi::Ffi::Bind()
      .Arg<xla::ffi::AnyBuffer>()  // q [B, T, N, H]
      .Arg<xla::ffi::AnyBuffer>()  // k [B, S, K, H]
      .Arg<xla::ffi::AnyBuffer>()  // v [B, S, K, Hv], or rank 0: V = k[..., :value_head_dim]
      .Arg<xla::ffi::AnyBuffer>()  // indices int32 [B, T, K, topk]
      .Ret<xla::ffi::AnyBuffer>()  // o [B, T, N, Hv]
      .Ret<xla::ffi::AnyBuffer>()  // lse float32 [B, T, N]
      .Attr<float>("scale")
      .Attr<int32_t>("is_causal")
      .Attr<int32_t>("bottom_right")
      .Attr<int64_t>("value_head_dim"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaSparseBackwardCpu, jfa::SparseBackwardCpu,
    xla::ffi::Ffi::Bind()
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
      .Attr<float>("scale")
      .Attr<int32_t>("is_causal")
      .Attr<int32_t>("bottom_right")
      .Attr<int64_t>("value_head_dim")
      .Attr<int32_t>("deterministic"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaAttnDistCpu, jfa::AttnDistCpu,
    xla::ffi::Ffi::Bind()
      .Arg<xla::ffi::AnyBuffer>()  // q
      .Arg<xla::ffi::AnyBuffer>()  // k
      .Arg<xla::ffi::AnyBuffer>()  // indices
      .Arg<xla::ffi::AnyBuffer>()  // lse float32 [B, T, N], natural log
      .Ret<xla::ffi::AnyBuffer>()  // dist float32 [B, N / head_group, T, topk]
      .Attr<float>("scale")
      .Attr<int32_t>("is_causal")
      .Attr<int32_t>("bottom_right")
      .Attr<int64_t>("head_group"));
