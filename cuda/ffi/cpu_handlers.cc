// XLA FFI handlers for the CPU platform: decode, check, run the C++ FlashAttention-2 kernels.
#include "cpu/attention_cpu.h"
#include "ffi/decode.h"
#include "ffi/handlers.h"

namespace jfa {
namespace {

namespace ffi = xla::ffi;
using ffi_decode::decode_backward;
using ffi_decode::decode_forward;

ffi::Error ForwardCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, float scale,
                      int32_t is_causal) {
  AttentionParams p;
  if (auto e = decode_forward(q, k, v, *o, *lse, scale, is_causal, &p); e.failure()) return e;
  cpu::forward(p);
  return ffi::Error::Success();
}

ffi::Error BackwardCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                       ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                       ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                       ffi::Result<ffi::AnyBuffer> dv, float scale, int32_t is_causal) {
  AttentionParams p;
  if (auto e = decode_backward(q, k, v, o, lse, dout, dlse, *dq, *dk, *dv, scale, is_causal, &p);
      e.failure())
    return e;
  cpu::backward(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jfa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaForwardCpu, jfa::ForwardCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // q
                                  .Arg<xla::ffi::AnyBuffer>()  // k
                                  .Arg<xla::ffi::AnyBuffer>()  // v
                                  .Ret<xla::ffi::AnyBuffer>()  // o
                                  .Ret<xla::ffi::AnyBuffer>()  // lse
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("is_causal"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaBackwardCpu, jfa::BackwardCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // q
                                  .Arg<xla::ffi::AnyBuffer>()  // k
                                  .Arg<xla::ffi::AnyBuffer>()  // v
                                  .Arg<xla::ffi::AnyBuffer>()  // o
                                  .Arg<xla::ffi::AnyBuffer>()  // lse
                                  .Arg<xla::ffi::AnyBuffer>()  // dout
                                  .Arg<xla::ffi::AnyBuffer>()  // dlse
                                  .Ret<xla::ffi::AnyBuffer>()  // dq
                                  .Ret<xla::ffi::AnyBuffer>()  // dk
                                  .Ret<xla::ffi::AnyBuffer>()  // dv
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("is_causal"));
