// XLA FFI handlers for the CUDA platform: decode, check what the kernels support, launch on XLA's
// stream. Workspace (the float32 dQ accumulator and D = rowsum(dO∘O) − dLSE; the Hopper forward's
// tile counter) arrives as extra outputs that the lowering adds, so nothing is allocated per call and
// the handlers are safe to capture in CUDA graphs.
//
// Beyond the tensors the handlers take the same optional operands (rank 0 = absent; the boolean
// mask bit-packed, as jax_flashattn.PackedMask holds it) and attributes as the CPU handlers
// (attention_call.h), so that jax_flashattn lowers both platforms alike, plus the segment-id
// summaries the GPU kernels skip tiles with (jax_flashattn/_segment_chunks.py); d(bias) is a float32
// result in the bias's shape, accumulated by the kernels' atomics. On sm90 the Hopper kernels take
// the calls sm90::can_implement and can_implement_backward accept; the rest runs on the portable
// kernels. deterministic=True orders the backward's dQ adds (a semaphore workspace per dQ tile) and
// needs a bias without broadcast axes.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ffi/attention_call.h"
#include "ffi/decode_attention.h"
#include "ffi/handlers.h"
#include "sm80/api.h"
#ifdef JFA_HAS_SM90
#include "sm90/api.h"
#endif

namespace jfa {

int64_t cuda_accum_cols(int64_t H) {
#ifdef JFA_HAS_SM90
  return sm90::workspace_head_dim(int(H));
#else
  return H;
#endif
}

int64_t cuda_paged_page_rows(int64_t H) {
#ifdef JFA_HAS_SM90
  // Every built head dim is built for every built dtype (a build may leave a dtype out).
  for (DType dtype : {DType::kFloat16, DType::kBFloat16})
    if (sm90::kernel_head_dim(dtype, int(H)) >= 0) return sm90::kPagedPageRows;
  return 0;
#else
  (void)H;
  return 0;
#endif
}

#ifdef JFA_HAS_SM90
// Compute capability (major * 10 + minor) of the current device, queried once per device: an
// attribute query, never a synchronization, so the handler stays cheap and CUDA-graph safe.
static int device_capability() {
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

namespace {

namespace ffi = xla::ffi;
using ffi_decode::invalid;

#define JFA_CUDA_FORWARD(ARG, RET, ATTR)                                                      \
  JFA_FORWARD_TENSORS(ARG) JFA_MASK_OPERANDS(ARG) JFA_SEGMENT_CHUNK_OPERANDS(ARG)              \
  JFA_FORWARD_RESULTS(RET) RET(tile_counter) /* int32 [1], the Hopper scheduler's */          \
  JFA_ATTRS(ATTR)
// dslopes: float32 [B, N, ceil(S/64)] partial sums. Workspace: dq_accum float32 [lanes, B, N,
// padded T, C], softmax_d float32 [2, B, N, padded T], dq_semaphore int32 [lanes, B, N, ceil(T/64)],
// dkv_accum float32 [2, B, K, padded S, C] (causal GQA; else rank 0), C = cuda_accum_cols(H),
// mask_key_bits uint32 [B or 1, N or 1, S rounded up to 128, mask_words(T)] (with a mask, the
// bits' broadcast axes; else rank 0).
#define JFA_CUDA_BACKWARD(ARG, RET, ATTR)                                                     \
  JFA_BACKWARD_TENSORS(ARG) JFA_MASK_OPERANDS(ARG) JFA_SEGMENT_CHUNK_OPERANDS(ARG)             \
  JFA_BACKWARD_RESULTS(RET) RET(dq_accum) RET(softmax_d) RET(dq_semaphore) RET(dkv_accum)    \
  RET(mask_key_bits) JFA_ATTRS(ATTR) ATTR(int32_t, deterministic)

struct ForwardCall {
  cudaStream_t stream;
  JFA_FFI_CALL_FIELDS(JFA_CUDA_FORWARD)
};
struct BackwardCall {
  cudaStream_t stream;
  JFA_FFI_CALL_FIELDS(JFA_CUDA_BACKWARD)
};

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

cudaError_t forward_dispatch(const AttentionParams& p, cudaStream_t stream) {
#ifdef JFA_HAS_SM90
  if (hopper_allowed() && sm90::can_implement(p)) return sm90::forward(p, stream);
#endif
  return sm80::forward(p, stream);
}

// A paged cache is read in place by the Hopper forward only (the lowering gathers the pages for
// the other kernels).
ffi::Error check_paged_support(const AttentionParams& p) {
  if (!p.paged.present()) return ffi::Error::Success();
#ifdef JFA_HAS_SM90
  if (hopper_allowed() && sm90::can_implement(p)) return ffi::Error::Success();
#endif
  const int64_t rows = cuda_paged_page_rows(p.H);
  return invalid("block_table: paged key/value caches are read in place only by the Hopper (sm90) forward, at "
                 "page sizes that are multiples of " + std::to_string(rows > 0 ? rows : 16) + " (page_size " +
                 std::to_string(p.paged.page_size) + ", head dim " + std::to_string(p.H) +
                 "); paged_attention gathers the pages elsewhere");
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

ffi::Error ForwardCuda(ForwardCall c) {
  AttentionParams p;
  if (auto e = ffi_decode::decode_forward_call(c, &p); e.failure()) return e;
  if (auto e = ffi_decode::decode_segment_chunks(c.q_segment_chunks, c.kv_segment_chunks, &p); e.failure())
    return e;
  if (auto e = check_cuda_support(p); e.failure()) return e;
  if (auto e = check_paged_support(p); e.failure()) return e;
  if (auto e = ffi_decode::expect(*c.tile_counter, "tile counter workspace", {1}, ffi::DataType::S32); e.failure())
    return e;
  p.tile_counter = static_cast<int32_t*>(c.tile_counter->untyped_data());
  if (p.B == 0 || p.T == 0 || p.N == 0) return ffi::Error::Success();
  return launched(forward_dispatch(p, c.stream), "forward");
}

ffi::Error BackwardCuda(BackwardCall c) {
  AttentionParams p;
  if (auto e = ffi_decode::decode_backward_call(c, &p); e.failure()) return e;
  if (auto e = ffi_decode::decode_segment_chunks(c.q_segment_chunks, c.kv_segment_chunks, &p); e.failure())
    return e;
  if (auto e = ffi_decode::decode_dbias(*c.dbias, /*allow_full=*/true, &p); e.failure()) return e;
  // One slot per 64 keys: a backward CTA owns a key tile of 64 or 128 keys (sm80/kernel_traits.h).
  if (auto e = ffi_decode::decode_dslopes(*c.dslopes, (p.S + kDslopeKeys - 1) / kDslopeKeys, &p); e.failure())
    return e;
  if (auto e = check_cuda_support(p); e.failure()) return e;
  // The deterministic mode's dQ lanes (sm80/dq_accum.h): kDqLanes copies of the accumulator. Rows
  // as wide as the Hopper kernel that runs this head dim (params.h, accum_cols).
  const int64_t lanes = c.deterministic != 0 ? kDqLanes : 1;
  p.accum_cols = cuda_accum_cols(p.H);
  if (auto e = ffi_decode::expect(*c.dq_accum, "dq workspace", {lanes, p.B, p.N, p.dq_accum_rows(), p.accum_cols},
                                  ffi::DataType::F32);
      e.failure())
    return e;
  // Row statistics (params.h): D, and LSE·log2 e for the Hopper backward, in padded rows.
  if (auto e = ffi_decode::expect(*c.softmax_d, "row statistics workspace", {2, p.B, p.N, p.dq_accum_rows()},
                                  ffi::DataType::F32);
      e.failure())
    return e;
  if (auto e = ffi_decode::expect(*c.dq_semaphore, "dq semaphore workspace",
                                  {lanes, p.B, p.N, p.dq_semaphores_per_head()}, ffi::DataType::S32);
      e.failure())
    return e;
  if (c.deterministic != 0 && p.mask.dbias != nullptr) {
    const int64_t full[4] = {p.B, p.N, p.T, p.S};
    for (int a = 0; a < 4; ++a)
      if (p.mask.dbias_dims[a] != full[a])
        return invalid("deterministic=True on the GPU needs the dbias output in the full [B, N, T, S] shape "
                       "(a bias's broadcast axes would otherwise be summed with float atomics), got " +
                       ffi_decode::shape_str(c.dbias->dimensions()));
  }
  // GQA's dK and dV partial sums (params.h): rank 0 where the lowering has none to give.
  if (c.dkv_accum->dimensions().size() != 0) {
    if (auto e = ffi_decode::expect(*c.dkv_accum, "dk/dv workspace", {2, p.B, p.K, p.dkv_accum_rows(), p.accum_cols},
                                    ffi::DataType::F32);
        e.failure())
      return e;
    p.dkv_accum = static_cast<float*>(c.dkv_accum->untyped_data());
  }
  // The mask's bits by key, which the Hopper backward makes (sm90/bwd_mask_columns.h): rank 0
  // where the lowering has no mask.
  if (c.mask_key_bits->dimensions().size() != 0) {
    const PackedMaskView& m = p.mask.packed_mask;
    const int64_t batches = m.bits_batch_stride != 0 ? p.B : 1, heads = m.bits_head_stride != 0 ? p.N : 1;
    if (auto e = ffi_decode::expect(*c.mask_key_bits, "mask key-bits workspace",
                                    {batches, heads, mask_chunks(p.S) * kMaskChunkKeys, mask_words(p.T)},
                                    ffi::DataType::U32);
        e.failure())
      return e;
    p.mask_key_bits = static_cast<uint32_t*>(c.mask_key_bits->untyped_data());
  } else if (p.mask.packed_mask.present()) {
    return invalid("a mask's backward needs the mask key-bits workspace, got a rank-0 placeholder");
  }
  p.dq_accum = static_cast<float*>(c.dq_accum->untyped_data());
  p.softmax_d = static_cast<float*>(c.softmax_d->untyped_data());
  p.deterministic = c.deterministic != 0;
  p.dq_semaphore = static_cast<int32_t*>(c.dq_semaphore->untyped_data());
  if (p.B == 0 || p.N == 0 || (p.T == 0 && p.S == 0)) {
    // Nothing to launch; d(bias) and d(slopes) (maybe non-empty) are still all zeros.
    if (p.mask.dbias != nullptr) {
      const int64_t* d = p.mask.dbias_dims;
      const size_t bytes = size_t(d[0] * d[1] * d[2] * d[3]) * sizeof(float);
      if (bytes > 0)
        if (auto e = launched(cudaMemsetAsync(p.mask.dbias, 0, bytes, c.stream), "dbias memset"); e.failure())
          return e;
    }
    if (p.mask.dslopes != nullptr) {
      const size_t bytes = size_t(p.B * p.N * p.mask.dslope_slots) * sizeof(float);
      if (bytes > 0) return launched(cudaMemsetAsync(p.mask.dslopes, 0, bytes, c.stream), "dslopes memset");
    }
    return ffi::Error::Success();
  }
  return launched(backward_dispatch(p, p.softmax_d + p.B * p.N * p.dq_accum_rows(), c.stream), "backward");
}

}  // namespace
}  // namespace jfa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaForwardCuda, jfa::ffi_call::packed<jfa::ForwardCall>(jfa::ForwardCuda),
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  JFA_FFI_BIND(JFA_CUDA_FORWARD),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaBackwardCuda, jfa::ffi_call::packed<jfa::BackwardCall>(jfa::BackwardCuda),
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  JFA_FFI_BIND(JFA_CUDA_BACKWARD),
                              {xla::ffi::Traits::kCmdBufferCompatible});
