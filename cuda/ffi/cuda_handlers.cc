// XLA FFI handlers for the CUDA platform: decode, check what the kernels support, launch on XLA's
// stream. Workspace (the float32 dQ accumulator and D = rowsum(dO∘O) − dLSE; the Hopper forward's
// tile counter) arrives as extra outputs that the lowering adds, so nothing is allocated per call and the handlers are safe to
// capture in CUDA graphs.
//
// Beyond q, k, v the handlers take the same optional operands (rank 0 = absent; the boolean mask
// bit-packed, as jax_flashattn.PackedMask holds it) and attributes as the CPU handlers, in the same
// order (decode_mask.h), so that jax_flashattn lowers both platforms alike, plus the segment-id summaries the GPU kernels skip tiles with (rank 0 without segment
// ids; jax_flashattn/_segment_chunks.py); d(bias) is a float32 result in the bias's shape,
// accumulated by the kernels' atomics. On
// sm90 the Hopper forward takes every mask feature and dropout (head dims 64, 128, 256), and the
// Hopper backward plain and causal calls (head dims 64, 128); the rest runs on the portable kernels.
// deterministic=True orders the backward's dQ adds (a semaphore workspace per dQ tile) and needs a
// bias without broadcast axes.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ffi/decode.h"
#include "ffi/decode_mask.h"
#include "ffi/decode_packed_mask.h"
#include "ffi/handlers.h"
#include "sm80/api.h"
#ifdef JFA_HAS_SM90
#include "sm90/api.h"
#endif

namespace jfa {
namespace {

namespace ffi = xla::ffi;
using ffi_decode::decode_backward;
using ffi_decode::decode_forward;
using ffi_decode::invalid;
using ffi_decode::MaskAttrs;
using ffi_decode::MaskOperands;

// What the CUDA kernels need beyond a valid attention call.
ffi::Error check_cuda_support(const AttentionParams& p) {
  if (p.dtype == DType::kFloat32)
    return invalid("the CUDA kernels take float16 or bfloat16 inputs, got float32");
  if (p.H != p.Hv)
    return invalid("the CUDA kernels need equal head dims for key and value, got H=" +
                   std::to_string(p.H) + ", Hv=" + std::to_string(p.Hv));
  if (!sm80::is_built(p.dtype, static_cast<int>(p.H)))
    return invalid("head dim " + std::to_string(p.H) + " for " + dtype_name(p.dtype) +
                   " is not built (built: " + sm80::built_variants() + ")");
  return ffi::Error::Success();
}

#ifdef JFA_HAS_SM90
// Compute capability (major * 10 + minor) of the current device, queried once per device: an
// attribute query, never a synchronization, so the handler stays cheap and CUDA-graph safe.
int device_capability() {
  static std::atomic<int> cache[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
  int cap = cache[device].load(std::memory_order_relaxed);
  if (cap == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    cap = major * 10 + minor;
    cache[device].store(cap, std::memory_order_relaxed);
  }
  return cap;
}

// The kernels for this call: the Hopper ones on a compute capability 9.0 device when they were
// built for (dtype, head dim) and take the call, else the portable ones. JFA_FORCE_SM80=1 forces
// the portable kernels. It is read at every dispatch (a getenv, no allocation), so one process can
// time both (benchmarks/bench_attention.py sets it around its jax_flashattn_sm80 rows); a jitted
// function captured into a CUDA graph keeps the kernels it was captured with.
bool hopper_allowed() {
  const char* force = std::getenv("JFA_FORCE_SM80");
  const bool forced = force != nullptr && std::strcmp(force, "1") == 0;
  return !forced && device_capability() == 90;
}
#endif

cudaError_t forward_dispatch(const AttentionParams& p, cudaStream_t stream) {
#ifdef JFA_HAS_SM90
  if (hopper_allowed() && sm90::can_implement(p)) return sm90::forward(p, stream);
#endif
  return sm80::forward(p, stream);
}

// `lse_log2`: the row-statistics workspace's second plane, which only the Hopper backward uses.
cudaError_t backward_dispatch(AttentionParams p, float* lse_log2, cudaStream_t stream) {
#ifdef JFA_HAS_SM90
  if (hopper_allowed() && sm90::can_implement_backward(p)) {
    p.lse_log2 = lse_log2;
    return sm90::backward(p, stream);
  }
#endif
  (void)lse_log2;
  return sm80::backward(p, stream);
}

ffi::Error launched(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_flashattn: ") + what +
                              " kernel launch failed: " + cudaGetErrorString(err));
}

ffi::Error ForwardCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer bias, ffi::AnyBuffer mask_bits, ffi::AnyBuffer mask_tiles, ffi::AnyBuffer q_lengths,
                       ffi::AnyBuffer kv_lengths, ffi::AnyBuffer q_segment_ids,
                       ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer alibi_slopes,
                       ffi::AnyBuffer dropout_seeds, ffi::AnyBuffer positions, ffi::AnyBuffer q_segment_chunks,
                       ffi::AnyBuffer kv_segment_chunks, ffi::Result<ffi::AnyBuffer> o,
                       ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> tile_counter,
                       float scale, int32_t is_causal,
                       int32_t bottom_right, int64_t window_left, int64_t window_right,
                       float softcap, float dropout_rate) {
  AttentionParams p;
  if (auto e = decode_forward(q, k, v, *o, *lse, scale, is_causal, &p); e.failure()) return e;
  const MaskOperands extra{bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, alibi_slopes,
                           dropout_seeds, positions};
  const MaskAttrs attrs{bottom_right, window_left, window_right, softcap, dropout_rate};
  if (auto e = ffi_decode::decode_mask(extra, attrs, &p); e.failure()) return e;
  if (auto e = ffi_decode::decode_packed_mask(mask_bits, mask_tiles, p, &p.mask.packed_mask); e.failure()) return e;
  if (auto e = ffi_decode::decode_segment_chunks(q_segment_chunks, kv_segment_chunks, &p); e.failure()) return e;
  if (auto e = check_cuda_support(p); e.failure()) return e;
  if (auto e = ffi_decode::expect(*tile_counter, "tile counter workspace", {1}, ffi::DataType::S32); e.failure())
    return e;
  p.tile_counter = static_cast<int32_t*>(tile_counter->untyped_data());
  if (p.B == 0 || p.T == 0 || p.N == 0) return ffi::Error::Success();
  return launched(forward_dispatch(p, stream), "forward");
}

ffi::Error BackwardCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                        ffi::AnyBuffer dlse, ffi::AnyBuffer bias, ffi::AnyBuffer mask_bits, ffi::AnyBuffer mask_tiles,
                        ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                        ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                        ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer dropout_seeds, ffi::AnyBuffer positions,
                        ffi::AnyBuffer q_segment_chunks, ffi::AnyBuffer kv_segment_chunks,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> dslopes, ffi::Result<ffi::AnyBuffer> dq_accum,
                        ffi::Result<ffi::AnyBuffer> softmax_d, ffi::Result<ffi::AnyBuffer> dq_semaphore,
                        ffi::Result<ffi::AnyBuffer> dkv_accum,
                        float scale, int32_t is_causal, int32_t bottom_right, int64_t window_left,
                        int64_t window_right, float softcap, float dropout_rate, int32_t deterministic) {
  AttentionParams p;
  if (auto e = decode_backward(q, k, v, o, lse, dout, dlse, *dq, *dk, *dv, scale, is_causal, &p);
      e.failure())
    return e;
  const MaskOperands extra{bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, alibi_slopes,
                           dropout_seeds, positions};
  const MaskAttrs attrs{bottom_right, window_left, window_right, softcap, dropout_rate};
  if (auto e = ffi_decode::decode_mask(extra, attrs, &p); e.failure()) return e;
  if (auto e = ffi_decode::decode_packed_mask(mask_bits, mask_tiles, p, &p.mask.packed_mask); e.failure()) return e;
  if (auto e = ffi_decode::decode_segment_chunks(q_segment_chunks, kv_segment_chunks, &p); e.failure()) return e;
  if (auto e = ffi_decode::decode_dbias(*dbias, /*allow_full=*/true, &p); e.failure()) return e;
  // One slot per 64 keys: a backward CTA owns a key tile of 64 or 128 keys (sm80/kernel_traits.h).
  if (auto e = ffi_decode::decode_dslopes(*dslopes, (p.S + kDslopeKeys - 1) / kDslopeKeys, &p); e.failure())
    return e;
  if (auto e = check_cuda_support(p); e.failure()) return e;
  // The deterministic mode's dQ lanes (sm80/dq_accum.h): kDqLanes copies of the accumulator.
  const int64_t lanes = deterministic != 0 ? kDqLanes : 1;
  if (auto e = ffi_decode::expect(*dq_accum, "dq workspace", {lanes, p.B, p.N, p.dq_accum_rows(), p.H},
                                  ffi::DataType::F32);
      e.failure())
    return e;
  // Row statistics (params.h): D, and LSE·log2 e for the Hopper backward, in padded rows.
  if (auto e = ffi_decode::expect(*softmax_d, "row statistics workspace", {2, p.B, p.N, p.dq_accum_rows()},
                                  ffi::DataType::F32);
      e.failure())
    return e;
  if (auto e = ffi_decode::expect(*dq_semaphore, "dq semaphore workspace",
                                  {lanes, p.B, p.N, p.dq_semaphores_per_head()}, ffi::DataType::S32);
      e.failure())
    return e;
  if (deterministic != 0 && p.mask.dbias != nullptr) {
    const int64_t full[4] = {p.B, p.N, p.T, p.S};
    for (int a = 0; a < 4; ++a)
      if (p.mask.dbias_dims[a] != full[a])
        return invalid("deterministic=True on the GPU needs the dbias output in the full [B, N, T, S] shape "
                       "(a bias's broadcast axes would otherwise be summed with float atomics), got " +
                       ffi_decode::shape_str(dbias->dimensions()));
  }
  // GQA's dK and dV partial sums (params.h): rank 0 where the lowering has none to give.
  if (dkv_accum->dimensions().size() != 0) {
    if (auto e = ffi_decode::expect(*dkv_accum, "dk/dv workspace", {2, p.B, p.K, p.dkv_accum_rows(), p.H},
                                    ffi::DataType::F32);
        e.failure())
      return e;
    p.dkv_accum = static_cast<float*>(dkv_accum->untyped_data());
  }
  p.dq_accum = static_cast<float*>(dq_accum->untyped_data());
  p.softmax_d = static_cast<float*>(softmax_d->untyped_data());
  p.deterministic = deterministic != 0;
  p.dq_semaphore = static_cast<int32_t*>(dq_semaphore->untyped_data());
  if (p.B == 0 || p.N == 0 || (p.T == 0 && p.S == 0)) {
    // Nothing to launch; d(bias) and d(slopes) (maybe non-empty) are still all zeros.
    if (p.mask.dbias != nullptr) {
      const int64_t* d = p.mask.dbias_dims;
      const size_t bytes = size_t(d[0] * d[1] * d[2] * d[3]) * sizeof(float);
      if (bytes > 0)
        if (auto e = launched(cudaMemsetAsync(p.mask.dbias, 0, bytes, stream), "dbias memset"); e.failure())
          return e;
    }
    if (p.mask.dslopes != nullptr) {
      const size_t bytes = size_t(p.B * p.N * p.mask.dslope_slots) * sizeof(float);
      if (bytes > 0) return launched(cudaMemsetAsync(p.mask.dslopes, 0, bytes, stream), "dslopes memset");
    }
    return ffi::Error::Success();
  }
  return launched(backward_dispatch(p, p.softmax_d + p.B * p.N * p.dq_accum_rows(), stream), "backward");
}

}  // namespace
}  // namespace jfa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaForwardCuda, jfa::ForwardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // q
                                  .Arg<xla::ffi::AnyBuffer>()  // k
                                  .Arg<xla::ffi::AnyBuffer>()  // v
                                  .Arg<xla::ffi::AnyBuffer>()  // bias, float32 broadcastable to [B, N, T, S]
                                  .Arg<xla::ffi::AnyBuffer>()  // mask bits, uint32 [B|1, N|1, T, ceil(S/128)*4]
                                  .Arg<xla::ffi::AnyBuffer>()  // mask tile summaries, uint8 [B|1, N|1, ceil(T/64), ceil(S/128)]
                                  .Arg<xla::ffi::AnyBuffer>()  // query_seq_lengths, int32 [B]
                                  .Arg<xla::ffi::AnyBuffer>()  // key_value_seq_lengths, int32 [B]
                                  .Arg<xla::ffi::AnyBuffer>()  // q_segment_ids, int32 [B, T]
                                  .Arg<xla::ffi::AnyBuffer>()  // kv_segment_ids, int32 [B, S]
                                  .Arg<xla::ffi::AnyBuffer>()  // alibi_slopes, float32 [1 or B, N]
                                  .Arg<xla::ffi::AnyBuffer>()  // dropout seeds, uint32 [B, 3]
                                  .Arg<xla::ffi::AnyBuffer>()  // positions of query row 0 and key 0, int32 [B, 2]
                                  .Arg<xla::ffi::AnyBuffer>()  // q segment summaries, int32 [B, ceil(T/16), 8]
                                  .Arg<xla::ffi::AnyBuffer>()  // kv segment summaries, int32 [B, ceil(S/16), 8]
                                  .Ret<xla::ffi::AnyBuffer>()  // o
                                  .Ret<xla::ffi::AnyBuffer>()  // lse
                                  .Ret<xla::ffi::AnyBuffer>()  // tile counter workspace, int32 [1] (Hopper scheduler)
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("is_causal")
                                  .Attr<int32_t>("bottom_right")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<float>("softcap")
                                  .Attr<float>("dropout_rate"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaBackwardCuda, jfa::BackwardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // q
                                  .Arg<xla::ffi::AnyBuffer>()  // k
                                  .Arg<xla::ffi::AnyBuffer>()  // v
                                  .Arg<xla::ffi::AnyBuffer>()  // o
                                  .Arg<xla::ffi::AnyBuffer>()  // lse
                                  .Arg<xla::ffi::AnyBuffer>()  // dout
                                  .Arg<xla::ffi::AnyBuffer>()  // dlse
                                  .Arg<xla::ffi::AnyBuffer>()  // bias, float32 broadcastable to [B, N, T, S]
                                  .Arg<xla::ffi::AnyBuffer>()  // mask bits, uint32 [B|1, N|1, T, ceil(S/128)*4]
                                  .Arg<xla::ffi::AnyBuffer>()  // mask tile summaries, uint8 [B|1, N|1, ceil(T/64), ceil(S/128)]
                                  .Arg<xla::ffi::AnyBuffer>()  // query_seq_lengths, int32 [B]
                                  .Arg<xla::ffi::AnyBuffer>()  // key_value_seq_lengths, int32 [B]
                                  .Arg<xla::ffi::AnyBuffer>()  // q_segment_ids, int32 [B, T]
                                  .Arg<xla::ffi::AnyBuffer>()  // kv_segment_ids, int32 [B, S]
                                  .Arg<xla::ffi::AnyBuffer>()  // alibi_slopes, float32 [1 or B, N]
                                  .Arg<xla::ffi::AnyBuffer>()  // dropout seeds, uint32 [B, 3]
                                  .Arg<xla::ffi::AnyBuffer>()  // positions of query row 0 and key 0, int32 [B, 2]
                                  .Arg<xla::ffi::AnyBuffer>()  // q segment summaries, int32 [B, ceil(T/16), 8]
                                  .Arg<xla::ffi::AnyBuffer>()  // kv segment summaries, int32 [B, ceil(S/16), 8]
                                  .Ret<xla::ffi::AnyBuffer>()  // dq
                                  .Ret<xla::ffi::AnyBuffer>()  // dk
                                  .Ret<xla::ffi::AnyBuffer>()  // dv
                                  .Ret<xla::ffi::AnyBuffer>()  // dbias, float32 in the bias's shape (rank 0 without a bias)
                                  .Ret<xla::ffi::AnyBuffer>()  // dslopes, float32 [B, N, ceil(S/64)] partial sums (rank 0 without ALiBi)
                                  .Ret<xla::ffi::AnyBuffer>()  // dq workspace, float32 [B, N, padded T, H]
                                  .Ret<xla::ffi::AnyBuffer>()  // row statistics workspace, float32 [2, B, N, padded T]
                                  .Ret<xla::ffi::AnyBuffer>()  // dq semaphore workspace, int32 [B, N, ceil(T/64)]
                                  .Ret<xla::ffi::AnyBuffer>()  // dk/dv workspace, float32 [2, B, K, padded S, H] (causal GQA; else rank 0)
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("is_causal")
                                  .Attr<int32_t>("bottom_right")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<float>("softcap")
                                  .Attr<float>("dropout_rate")
                                  .Attr<int32_t>("deterministic"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
