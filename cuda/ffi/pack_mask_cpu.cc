// XLA FFI handler of jax_flashattn.pack_mask on the CPU platform.
#include "cpu/pack_mask.h"
#include "ffi/decode_pack_mask.h"
#include "ffi/handlers.h"

namespace jfa {
namespace {

namespace ffi = xla::ffi;

ffi::Error PackMaskCpu(ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> bits,
                       ffi::Result<ffi::AnyBuffer> tiles, int64_t q_len, int64_t kv_len) {
  ffi_decode::PackMaskCall call;
  if (auto e = ffi_decode::decode_pack_mask(mask, *bits, *tiles, q_len, kv_len, &call); e.failure()) return e;
  cpu::pack_mask(call.mask, call.bits, call.tiles);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jfa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaPackMaskCpu, jfa::PackMaskCpu,
    xla::ffi::Ffi::Bind()
      .Arg<xla::ffi::AnyBuffer>()  // mask, bool [Bm, Nm, T or 1, S or 1]
      .Ret<xla::ffi::AnyBuffer>()  // bits, uint32 [Bm, Nm, T, ceil(S/128)*4]
      .Ret<xla::ffi::AnyBuffer>()  // tiles, uint8 [Bm, Nm, ceil(T/64), ceil(S/128)]
      .Attr<int64_t>("q_len")
      .Attr<int64_t>("kv_len"));
