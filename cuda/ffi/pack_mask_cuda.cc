// XLA FFI handler of jax_flashattn.pack_mask on the CUDA platform: enqueues the packing kernels
// on XLA's stream (nothing allocated, no synchronization: safe to capture in CUDA graphs).
#include <cuda_runtime_api.h>

#include <string>

#include "ffi/decode_pack_mask.h"
#include "ffi/handlers.h"
#include "packed_mask/pack_mask.h"

namespace jfa {
namespace {

namespace ffi = xla::ffi;

ffi::Error PackMaskCuda(cudaStream_t stream, ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> bits,
                        ffi::Result<ffi::AnyBuffer> tiles, int64_t q_len, int64_t kv_len) {
  ffi_decode::PackMaskCall call;
  if (auto e = ffi_decode::decode_pack_mask(mask, *bits, *tiles, q_len, kv_len, &call); e.failure()) return e;
  const cudaError_t err = gpu::pack_mask(call.mask, call.bits, call.tiles, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_flashattn: pack_mask kernel launch failed: ") +
                                cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jfa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaPackMaskCuda, jfa::PackMaskCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // mask, bool [Bm, Nm, T or 1, S or 1]
                                  .Ret<xla::ffi::AnyBuffer>()  // bits, uint32 [Bm, Nm, T, ceil(S/128)*4]
                                  .Ret<xla::ffi::AnyBuffer>()  // tiles, uint8 [Bm, Nm, ceil(T/64), ceil(S/128)]
                                  .Attr<int64_t>("q_len")
                                  .Attr<int64_t>("kv_len"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
