// XLA FFI handlers for the CPU platform: decode, check, run the C++ FlashAttention-2 kernels.
//
// Beyond the tensors the handlers take every masking/training operand and attribute that
// attention_call.h lists (rank 0 = absent). The lowering packs a boolean mask before it reaches
// them (jax_flashattn/primitives.py).
#include <vector>

#include "cpu/attention_cpu.h"
#include "cpu/paged_kv.h"
#include "ffi/attention_call.h"
#include "ffi/decode_attention.h"
#include "ffi/handlers.h"

namespace jfa {
namespace {

namespace ffi = xla::ffi;

#define JFA_CPU_FORWARD(ARG, RET, ATTR) \
  JFA_FORWARD_TENSORS(ARG) JFA_MASK_OPERANDS(ARG) JFA_FORWARD_RESULTS(RET) JFA_ATTRS(ATTR)
// dslopes is float32 [B, N]: the CPU backward adds its partial sums up itself.
#define JFA_CPU_BACKWARD(ARG, RET, ATTR) \
  JFA_BACKWARD_TENSORS(ARG) JFA_MASK_OPERANDS(ARG) JFA_BACKWARD_RESULTS(RET) JFA_ATTRS(ATTR)

struct ForwardCall {
  JFA_FFI_CALL_FIELDS(JFA_CPU_FORWARD)
};
struct BackwardCall {
  JFA_FFI_CALL_FIELDS(JFA_CPU_BACKWARD)
};

ffi::Error ForwardCpu(ForwardCall c) {
  AttentionParams p;
  if (auto e = ffi_decode::decode_forward_call(c, &p); e.failure()) return e;
  if (auto e = ffi_decode::check_positions_on_host(p); e.failure()) return e;
  if (p.paged.present()) {
    std::vector<char> k, v;
    cpu::forward(cpu::gather_pages(p, &k, &v));
  } else {
    cpu::forward(p);
  }
  return ffi::Error::Success();
}

ffi::Error BackwardCpu(BackwardCall c) {
  AttentionParams p;
  if (auto e = ffi_decode::decode_backward_call(c, &p); e.failure()) return e;
  if (auto e = ffi_decode::check_positions_on_host(p); e.failure()) return e;
  if (auto e = ffi_decode::decode_dbias(*c.dbias, /*allow_full=*/false, &p); e.failure()) return e;
  if (auto e = ffi_decode::decode_dslopes(*c.dslopes, ffi_decode::kDslopesComplete, &p); e.failure()) return e;
  cpu::backward(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jfa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaForwardCpu, jfa::ffi_call::packed<jfa::ForwardCall>(jfa::ForwardCpu),
                              xla::ffi::Ffi::Bind() JFA_FFI_BIND(JFA_CPU_FORWARD));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaBackwardCpu, jfa::ffi_call::packed<jfa::BackwardCall>(jfa::BackwardCpu),
                              xla::ffi::Ffi::Bind() JFA_FFI_BIND(JFA_CPU_BACKWARD));
