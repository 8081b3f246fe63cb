// XLA FFI handlers of top-k sparse attention (forward, backward) and attn_dist on the CPU platform.
#include "cpu/sparse_attention.h"
#include "ffi/decode_sparse.h"
#include "ffi/handlers.h"
#include "ffi/sparse_call.h"

namespace jfa {
namespace {

namespace ffi = xla::ffi;

#define JFA_SPARSE_BACKWARD_CPU(ARG, RET, ATTR)                                               \
  JFA_SPARSE_BACKWARD_OPERANDS(ARG) JFA_SPARSE_BACKWARD_RESULTS(RET) JFA_SPARSE_ATTRS(ATTR) \
  ATTR(int64_t, value_head_dim) ATTR(int32_t, deterministic)

struct SparseForwardCall {
  JFA_FFI_CALL_FIELDS(JFA_SPARSE_FORWARD)
};
struct SparseBackwardCall {
  JFA_FFI_CALL_FIELDS(JFA_SPARSE_BACKWARD_CPU)
};
struct AttnDistCall {
  JFA_FFI_CALL_FIELDS(JFA_ATTN_DIST)
};

ffi::Error SparseForwardCpu(SparseForwardCall c) {
  SparseParams p;
  if (auto e = ffi_decode::decode_sparse_forward_call(c, &p); e.failure()) return e;
  cpu::sparse_forward(p);
  return ffi::Error::Success();
}

ffi::Error SparseBackwardCpu(SparseBackwardCall c) {
  SparseParams p;
  if (auto e = ffi_decode::decode_sparse_backward_call(c, &p); e.failure()) return e;
  p.deterministic = c.deterministic != 0;  // the CPU backward is always deterministic
  cpu::sparse_backward(p);
  return ffi::Error::Success();
}

ffi::Error AttnDistCpu(AttnDistCall c) {
  SparseParams p;
  if (auto e = ffi_decode::decode_attn_dist_call(c, &p); e.failure()) return e;
  cpu::attn_dist(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jfa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaSparseForwardCpu,
                              jfa::ffi_call::packed<jfa::SparseForwardCall>(jfa::SparseForwardCpu),
                              xla::ffi::Ffi::Bind() JFA_FFI_BIND(JFA_SPARSE_FORWARD));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaSparseBackwardCpu,
                              jfa::ffi_call::packed<jfa::SparseBackwardCall>(jfa::SparseBackwardCpu),
                              xla::ffi::Ffi::Bind() JFA_FFI_BIND(JFA_SPARSE_BACKWARD_CPU));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaAttnDistCpu, jfa::ffi_call::packed<jfa::AttnDistCall>(jfa::AttnDistCpu),
                              xla::ffi::Ffi::Bind() JFA_FFI_BIND(JFA_ATTN_DIST));
