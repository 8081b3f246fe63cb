// The sparse-attention CUDA kernels (cuda/sparse/) against the C++ CPU kernels (cuda/cpu/sparse_*),
// which tests/test_sparse_attention.py checks against the float32 reference: forward (o, lse),
// backward (dq, dk, dv; atomics on tensor cores and on CUDA cores, and the ordered scatter, run
// twice and compared bit for bit) and attn_dist, on random float16 / bfloat16 problems with invalid
// (-1, negative, >= S, int32 extremes, causally hidden) and repeated indices, rows with no valid
// index, value shared with key or not. GPU outputs are poisoned (NaN) before each launch and every element is checked.
// Standalone, so that compute-sanitizer runs it without JAX (--small: a few small cases).
//
//   nvcc -std=c++17 -O2 -arch=native -Icuda -Icuda/include tests/cuda/sparse_check.cu cuda/sparse/*.cu \
//     cuda/cpu/sparse_forward.cc cuda/cpu/sparse_backward.cc cuda/cpu/tiles.cc cuda/cpu/parallel_for.cc \
//     -o /tmp/sparse_check
//   /tmp/sparse_check [--small | --bench [T [S]]]     (--bench: T 4096, S 32768 unless given)
//
// With -DJFA_SPARSE_CHECK_SM90 it checks (and times) the Hopper forward, attn_dist and the backward's
// two passes too: add the compiled cuda/sm90/sparse_fwd.cu, sparse_dist.cu, sparse_bwd.cu and
// sparse_key_rows.cu (nvcc -arch=sm_90a -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
// --expt-relaxed-constexpr -isystem <CuTe include> -c) to the link. JFA_SPARSE_CHECK_HOPPER=0
// leaves them out of a run, =forward, =attn_dist or =backward runs that one alone (racecheck:
// docs/sparse-attention.md#checks).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "check_util.h"
#include "cpu/sparse_attention.h"
#include "sparse/sparse_gpu.h"
#ifdef JFA_SPARSE_CHECK_SM90
#include "sm90/api.h"
#endif

using jfa::DType;
using jfa::SparseParams;

namespace {

struct Case {
  int64_t B, T, S, N, K, H, Hv, topk;
  bool shared_value, causal, bottom_right;
  DType dtype;
  int64_t head_group;
};

// A device buffer of `count` elements of `bytes` each, filled with 0xff bytes (NaN in every float type).
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t size = 0;
  DeviceBuffer(size_t count, size_t bytes) : size(count * bytes) {
    CK(cudaMalloc(&ptr, size ? size : 1));
    poison();
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  void poison() { CK(cudaMemset(ptr, 0xff, size)); }
  template <typename T>
  void upload(const std::vector<T>& host) { CK(cudaMemcpy(ptr, host.data(), size, cudaMemcpyHostToDevice)); }
  template <typename T>
  std::vector<T> download() const {
    std::vector<T> host(size / sizeof(T));
    CK(cudaMemcpy(host.data(), ptr, size, cudaMemcpyDeviceToHost));
    return host;
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
};

std::vector<uint16_t> random_half(size_t n, DType dt, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<uint16_t> x(n);
  for (auto& e : x) e = from_float(normal(rng), dt);
  return x;
}

// About a quarter invalid (negative, >= S, int32 extremes), repeats for certain when topk > S, and
// query row 0 of every batch with no valid index.
std::vector<int32_t> random_indices(const Case& c, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> index(-static_cast<int32_t>(c.S) / 4 - 1, static_cast<int32_t>(c.S + c.S / 4));
  std::uniform_real_distribution<float> unit;
  std::vector<int32_t> x(c.B * c.T * c.K * c.topk);
  for (size_t i = 0; i < x.size(); ++i) {
    const float u = unit(rng);
    x[i] = u < 0.03f ? INT32_MIN : u < 0.06f ? INT32_MAX : index(rng);
    if ((i / (c.K * c.topk)) % c.T == 0) x[i] = -1;
  }
  return x;
}

std::vector<float> as_float(const std::vector<uint16_t>& x, DType dt) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = to_float(x[i], dt);
  return y;
}

// ‖x − ref‖ / ‖ref‖ over the finite reference entries; every x must be finite there and equal
// (-inf) where the reference is -inf. Returns +inf on a mismatch of finiteness.
double rel_err(const std::vector<float>& x, const std::vector<float>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isinf(ref[i])) {
      if (x[i] != ref[i]) return INFINITY;
      continue;
    }
    if (!std::isfinite(x[i])) return INFINITY;
    diff += (double(x[i]) - ref[i]) * (double(x[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

int g_failures = 0;

void expect(bool ok, const char* what, double err, const Case& c) {
  if (ok) return;
  ++g_failures;
  printf("FAIL %s err %.3g: B%lld T%lld S%lld N%lld K%lld H%lld Hv%lld topk%lld shared%d causal%d br%d %s\n", what,
         err, (long long)c.B, (long long)c.T, (long long)c.S, (long long)c.N, (long long)c.K, (long long)c.H,
         (long long)c.Hv, (long long)c.topk, c.shared_value, c.causal, c.bottom_right, jfa::dtype_name(c.dtype));
}

SparseParams shape_params(const Case& c) {
  SparseParams p;
  p.dtype = c.dtype;
  p.B = c.B; p.T = c.T; p.S = c.S; p.N = c.N; p.K = c.K; p.H = c.H; p.Hv = c.Hv; p.topk = c.topk;
  p.scale = 1.f / std::sqrt(float(c.H));
  p.is_causal = c.causal;
  p.causal_offset = c.bottom_right ? c.S - c.T : 0;
  p.head_group = c.head_group;
  return p;
}

// One of the kernels a public entry point chooses between.
struct Kernel {
  std::string name;
  std::function<cudaError_t(const SparseParams&, cudaStream_t)> run;
};

#ifdef JFA_SPARSE_CHECK_SM90
// The Hopper kernels, or cudaErrorNotSupported (a skipped kernel) where JFA_SPARSE_CHECK_HOPPER
// leaves them out: 0 all; forward, attn_dist or backward runs that one alone (racecheck reports the
// forward's and the backward's exchanges: docs/sparse-attention.md#checks).
bool hopper_runs(const std::string& kernel) {
  const char* run = std::getenv("JFA_SPARSE_CHECK_HOPPER");
  const std::string only = run == nullptr ? "1" : run;
  return only == "1" || only == kernel;
}
cudaError_t hopper_forward(const SparseParams& p, cudaStream_t stream) {
  return hopper_runs("forward") ? jfa::sm90::sparse_forward(p, stream) : cudaErrorNotSupported;
}
cudaError_t hopper_attn_dist(const SparseParams& p, cudaStream_t stream) {
  return hopper_runs("attn_dist") ? jfa::sm90::attn_dist(p, stream) : cudaErrorNotSupported;
}
// Whether a Hopper pass declined a chunk since the last look: the chunk then ran on the mma.sync
// pass, and a run meant to check the Hopper one would pass without it.
bool hopper_pass_declined = false;
cudaError_t checked_first_pass(const SparseParams& p, const float* softmax_d, void* weights, int64_t first_item,
                               int64_t count, cudaStream_t stream) {
  const cudaError_t e = jfa::sm90::sparse_backward_weights(p, softmax_d, weights, first_item, count, stream);
  hopper_pass_declined |= e == cudaErrorNotSupported;
  return e;
}
cudaError_t checked_second_pass(const SparseParams& p, const void* weights, float* accum, int64_t first_item,
                                int64_t count, cudaStream_t stream) {
  const cudaError_t e = jfa::sm90::sparse_key_rows(p, weights, accum, first_item, count, stream);
  hopper_pass_declined |= e == cudaErrorNotSupported;
  return e;
}
// The Hopper passes of the tensor-core backward that take the call (none: the runs with them are
// left out rather than repeating the mma.sync ones).
jfa::sparse_gpu::BackwardPasses hopper_backward_passes(const SparseParams& p) {
  jfa::sparse_gpu::BackwardPasses passes;
  if (!hopper_runs("backward")) return passes;
  if (jfa::sm90::can_implement_sparse_backward_weights(p)) passes.first = checked_first_pass;
  if (jfa::sm90::can_implement_sparse_key_rows(p)) passes.second = checked_second_pass;
  return passes;
}
#else
bool hopper_pass_declined = false;
jfa::sparse_gpu::BackwardPasses hopper_backward_passes(const SparseParams&) { return {}; }
#endif

// Runs `kernel` and waits for it; false (and a note) when it does not take the call.
bool launched(const Kernel& kernel, const SparseParams& g, const Case& c) {
  const cudaError_t e = kernel.run(g, nullptr);
  if (e == cudaErrorNotSupported) {
    printf("  (%s does not take H%lld Hv%lld N%lld K%lld group %lld)\n", kernel.name.c_str(), (long long)c.H,
           (long long)c.Hv, (long long)c.N, (long long)c.K, (long long)c.head_group);
    return false;
  }
  CK(e);
  CK(cudaDeviceSynchronize());
  return true;
}

void run_case(const Case& c, std::mt19937& rng) {
  const DType dt = c.dtype;
  const float fwd_bound = dt == DType::kBFloat16 ? 2e-2f : 3e-3f, grad_bound = 4 * fwd_bound;
  auto q = random_half(c.B * c.T * c.N * c.H, dt, rng), k = random_half(c.B * c.S * c.K * c.H, dt, rng);
  auto v = random_half(c.shared_value ? 0 : c.B * c.S * c.K * c.Hv, dt, rng);
  auto dout = random_half(c.B * c.T * c.N * c.Hv, dt, rng);
  std::vector<float> dlse(c.B * c.T * c.N);
  std::normal_distribution<float> normal;
  for (auto& e : dlse) e = normal(rng);
  const auto indices = random_indices(c, rng);

  // CPU: the reference.
  SparseParams h = shape_params(c);
  std::vector<uint16_t> o_ref(dout.size()), dq_ref(q.size()), dk_ref(k.size()), dv_ref(v.size());
  std::vector<float> lse_ref(dlse.size()), dist_ref(c.B * (c.N / c.head_group) * c.T * c.topk);
  h.q = q.data(); h.k = k.data(); h.v = c.shared_value ? nullptr : v.data(); h.indices = indices.data();
  h.o = o_ref.data(); h.lse = lse_ref.data();
  jfa::cpu::sparse_forward(h);
  for (size_t i = 0; i < dlse.size(); ++i)
    if (std::isinf(lse_ref[i])) dlse[i] = 0.f;
  h.dout = dout.data(); h.dlse = dlse.data(); h.dq = dq_ref.data(); h.dk = dk_ref.data();
  h.dv = c.shared_value ? nullptr : dv_ref.data();
  jfa::cpu::sparse_backward(h);
  h.dist = dist_ref.data();
  jfa::cpu::attn_dist(h);

  // GPU.
  DeviceBuffer d_q(q.size(), 2), d_k(k.size(), 2), d_v(v.size(), 2), d_idx(indices.size(), 4);
  DeviceBuffer d_o(dout.size(), 2), d_lse(dlse.size(), 4), d_dout(dout.size(), 2), d_dlse(dlse.size(), 4);
  DeviceBuffer d_dq(q.size(), 2), d_dk(k.size(), 2), d_dv(v.size(), 2), d_dist(dist_ref.size(), 4);
  DeviceBuffer d_dk_acc(k.size(), 4), d_dv_acc(c.shared_value ? 0 : c.B * c.S * c.K * c.Hv, 4);
  DeviceBuffer d_softmax_d(dlse.size(), 4);
  d_q.upload(q); d_k.upload(k); if (!c.shared_value) d_v.upload(v);
  d_idx.upload(indices); d_dout.upload(dout); d_dlse.upload(dlse);
  SparseParams g = shape_params(c);
  g.q = d_q.ptr; g.k = d_k.ptr; g.v = c.shared_value ? nullptr : d_v.ptr; g.indices = d_idx.as<int32_t>();
  g.o = d_o.ptr; g.lse = d_lse.as<float>();
  // Both forward kernels: the tensor-core one where it takes the call, and the CUDA-core one.
  for (const Kernel& kernel : {
#ifdef JFA_SPARSE_CHECK_SM90
           Kernel{"Hopper forward", hopper_forward},
#endif
           Kernel{"tensor-core forward", jfa::sparse_gpu::forward_tensor_cores},
           Kernel{"CUDA-core forward", jfa::sparse_gpu::forward_cuda_cores}}) {
    d_o.poison();
    d_lse.poison();
    if (!launched(kernel, g, c)) continue;
    const auto o = as_float(d_o.download<uint16_t>(), dt), lse = d_lse.download<float>();
    const double o_err = rel_err(o, as_float(o_ref, dt)), lse_err = rel_err(lse, lse_ref);
    expect(o_err <= fwd_bound, (kernel.name + " out").c_str(), o_err, c);
    expect(lse_err <= 1e-4, (kernel.name + " lse").c_str(), lse_err, c);
  }

  // The backward reads the CPU's o and lse, so both sides differentiate the same forward.
  d_o.upload(o_ref);
  d_lse.upload(lse_ref);
  g.dout = d_dout.ptr; g.dlse = d_dlse.as<float>(); g.dq = d_dq.ptr; g.dk = d_dk.ptr;
  g.dv = c.shared_value ? nullptr : d_dv.ptr;
  // The tensor-core backward's weights for a third of the items at a time (at least one), so
  // that the cases run its chunk loop.
  const int64_t weight_items = std::max<int64_t>(1, c.B * c.T * c.K / 3);
  DeviceBuffer d_weights(weight_items * 2 * (c.N / c.K) * jfa::sparse_gpu::weight_row_slots(c.topk), 2);
  jfa::sparse_gpu::SparseBackwardWorkspace ws{d_dk_acc.as<float>(), c.shared_value ? nullptr : d_dv_acc.as<float>(),
                                              d_softmax_d.as<float>(), d_weights.ptr, weight_items};
  std::vector<uint16_t> first_dk;
  using jfa::sparse_gpu::BackwardKernels;
  struct BackwardRun {
    std::string name;
    bool deterministic;
    BackwardKernels kernels;
    jfa::sparse_gpu::BackwardPasses passes = {};
  };
  // Atomics on tensor cores (where that kernel takes the call; also with each Hopper pass alone and
  // both where they take it: the second reads either first pass's weights) and on CUDA cores; the
  // ordered scatter twice.
  g.deterministic = false;
  std::vector<BackwardRun> runs{BackwardRun{"tensor-core backward", false, BackwardKernels::kTensorCores}};
  const jfa::sparse_gpu::BackwardPasses hopper = hopper_backward_passes(g);
  if (hopper.first)
    runs.push_back(BackwardRun{"Hopper first pass backward", false, BackwardKernels::kTensorCores, {hopper.first}});
  if (hopper.second)
    runs.push_back(
        BackwardRun{"Hopper second pass backward", false, BackwardKernels::kTensorCores, {nullptr, hopper.second}});
  if (hopper.first && hopper.second)
    runs.push_back(BackwardRun{"Hopper tensor-core backward", false, BackwardKernels::kTensorCores, hopper});
  runs.push_back(BackwardRun{"atomic backward", false, BackwardKernels::kCudaCores});
  runs.push_back(BackwardRun{"ordered backward", true, BackwardKernels::kAuto});
  runs.push_back(BackwardRun{"ordered backward", true, BackwardKernels::kAuto});
  for (const BackwardRun& run : runs) {
    g.deterministic = run.deterministic;
    d_dq.poison(); d_dk.poison(); d_dv.poison(); d_dk_acc.poison(); d_dv_acc.poison(); d_softmax_d.poison();
    d_weights.poison();
    hopper_pass_declined = false;
    if (!launched(Kernel{run.name, [&](const SparseParams& p, cudaStream_t stream) {
                           return jfa::sparse_gpu::backward(p, ws, stream, run.kernels, run.passes);
                         }},
                  g, c))
      continue;
    expect(!hopper_pass_declined, (run.name + ": every chunk ran its Hopper passes").c_str(), 0, c);
    const auto dk_raw = d_dk.download<uint16_t>();
    const double dq_err = rel_err(as_float(d_dq.download<uint16_t>(), dt), as_float(dq_ref, dt));
    const double dk_err = rel_err(as_float(dk_raw, dt), as_float(dk_ref, dt));
    expect(dq_err <= grad_bound, (run.name + " dq").c_str(), dq_err, c);
    expect(dk_err <= grad_bound, (run.name + " dk").c_str(), dk_err, c);
    if (!c.shared_value) {
      const double dv_err = rel_err(as_float(d_dv.download<uint16_t>(), dt), as_float(dv_ref, dt));
      expect(dv_err <= grad_bound, (run.name + " dv").c_str(), dv_err, c);
    }
    if (run.deterministic && !first_dk.empty()) expect(dk_raw == first_dk, "ordered dk bitwise repeat", 0, c);
    if (run.deterministic) first_dk = dk_raw;
  }

  // attn_dist's parameters as its FFI handler decodes them: no value, Hv = 1.
  g.dist = d_dist.as<float>();
  g.v = nullptr;
  g.Hv = 1;
  for (const Kernel& kernel : {
#ifdef JFA_SPARSE_CHECK_SM90
           Kernel{"Hopper attn_dist", hopper_attn_dist},
#endif
           Kernel{"tensor-core attn_dist", jfa::sparse_gpu::attn_dist_tensor_cores},
           Kernel{"CUDA-core attn_dist", jfa::sparse_gpu::attn_dist_cuda_cores}}) {
    d_dist.poison();
    if (!launched(kernel, g, c)) continue;
    const auto dist = d_dist.download<float>();
    const double dist_err = rel_err(dist, dist_ref);
    expect(dist_err <= 1e-4, kernel.name.c_str(), dist_err, c);
    // Twice, bit for bit: the output must not depend on the order in which CTAs add.
    d_dist.poison();
    CK(kernel.run(g, nullptr));
    CK(cudaDeviceSynchronize());
    expect(d_dist.download<float>() == dist, (kernel.name + " bitwise repeat").c_str(), 0, c);
  }
}

// Times the tensor-core forward, backward and attn_dist at DeepSeek V3.2's shapes (N 128, K 1, H 576,
// Hv 512, topk 2048, causal bottom-right, one slot in a hundred -1), FLOPs as
// benchmarks/bench_sparse.py counts them. A quick look without JAX; bench_sparse.py is the benchmark.
void bench(int64_t T, int64_t S) {
  Case c{1, T, S, 128, 1, 576, 512, 2048, true, true, true, DType::kBFloat16, 64};
  std::mt19937 rng(1);
  const auto q = random_half(c.T * c.N * c.H, c.dtype, rng), k = random_half(c.S * c.H, c.dtype, rng);
  std::vector<int32_t> indices(c.T * c.topk);
  std::uniform_real_distribution<double> unit;
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t j = 0; j < c.topk; ++j)
      indices[t * c.topk + j] = unit(rng) < 0.01 ? -1 : int32_t(unit(rng) * double(t + c.S - c.T + 1));
  DeviceBuffer d_q(q.size(), 2), d_k(k.size(), 2), d_idx(indices.size(), 4), d_o(c.T * c.N * c.Hv, 2);
  DeviceBuffer d_lse(c.T * c.N, 4), d_dist(c.T * (c.N / c.head_group) * c.topk, 4);
  d_q.upload(q); d_k.upload(k); d_idx.upload(indices);
  SparseParams g = shape_params(c);
  g.q = d_q.ptr; g.k = d_k.ptr; g.indices = d_idx.as<int32_t>(); g.o = d_o.ptr; g.lse = d_lse.as<float>();
  g.dist = d_dist.as<float>();
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  auto time_ms = [&](const std::function<cudaError_t(const SparseParams&, cudaStream_t)>& run, int reps) {
    CK(run(g, nullptr));
    CK(cudaEventRecord(start));
    for (int i = 0; i < reps; ++i) CK(run(g, nullptr));
    CK(cudaEventRecord(stop));
    CK(cudaEventSynchronize(stop));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, start, stop));
    return double(ms) / reps;
  };
  const double fwd_flops = 2.0 * c.topk * (c.H + c.Hv) * c.N * c.T, dist_flops = 2.0 * c.topk * c.H * c.N * c.T;
#ifdef JFA_SPARSE_CHECK_SM90
  const double hopper = time_ms(jfa::sm90::sparse_forward, 10);
  printf("bench T %lld S %lld: forward Hopper %.3f ms (%.1f TFLOP/s)\n", (long long)T, (long long)S, hopper,
         fwd_flops / hopper * 1e-9);
  const double hopper_dist = time_ms(jfa::sm90::attn_dist, 10);
  printf("bench T %lld S %lld: attn_dist Hopper %.3f ms (%.1f TFLOP/s)\n", (long long)T, (long long)S, hopper_dist,
         dist_flops / hopper_dist * 1e-9);
#endif
  const double tc = time_ms(jfa::sparse_gpu::forward_tensor_cores, 10);
  const double cc = time_ms(jfa::sparse_gpu::forward_cuda_cores, 1);
  const double tc_dist = time_ms(jfa::sparse_gpu::attn_dist_tensor_cores, 10);
  const double cc_dist = time_ms(jfa::sparse_gpu::attn_dist_cuda_cores, 1);
  printf("bench T %lld S %lld: forward tensor cores %.3f ms (%.1f TFLOP/s), CUDA cores %.3f ms (%.1f)\n",
         (long long)T, (long long)S, tc, fwd_flops / tc * 1e-9, cc, fwd_flops / cc * 1e-9);
  printf("bench T %lld S %lld: attn_dist tensor cores %.3f ms (%.1f TFLOP/s), CUDA cores %.3f ms (%.1f)\n",
         (long long)T, (long long)S, tc_dist, dist_flops / tc_dist * 1e-9, cc_dist, dist_flops / cc_dist * 1e-9);

  // The backward of the forward above (its o and lse), dO random, dLSE 0; the time includes D, the
  // accumulators' zeroing and their conversion.
  const auto dout = random_half(c.T * c.N * c.Hv, c.dtype, rng);
  DeviceBuffer d_dout(dout.size(), 2), d_dlse(c.T * c.N, 4), d_dq(q.size(), 2), d_dk(k.size(), 2);
  DeviceBuffer d_dk_acc(k.size(), 4), d_softmax_d(c.T * c.N, 4);
  d_dout.upload(dout);
  CK(cudaMemset(d_dlse.ptr, 0, sizeof(float) * c.T * c.N));
  CK(jfa::sparse_gpu::forward_tensor_cores(g, nullptr));
  g.dout = d_dout.ptr; g.dlse = d_dlse.as<float>(); g.dq = d_dq.ptr; g.dk = d_dk.ptr; g.dv = nullptr;
  // The tensor-core backward's weights as jax_flashattn sizes them: up to 1 GiB of items at once.
  const int64_t weight_row_bytes = 2 * (c.N / c.K) * jfa::sparse_gpu::weight_row_slots(c.topk) * 2;
  const int64_t bench_items = std::min<int64_t>(c.T * c.K, std::max<int64_t>(1, (int64_t{1} << 30) / weight_row_bytes));
  DeviceBuffer d_weights(bench_items * weight_row_bytes / 2, 2);
  const jfa::sparse_gpu::SparseBackwardWorkspace ws{d_dk_acc.as<float>(), nullptr, d_softmax_d.as<float>(),
                                                    d_weights.ptr, bench_items};
  auto backward_with = [&](jfa::sparse_gpu::BackwardKernels kernels) {
    return [&, kernels](const SparseParams& p, cudaStream_t stream) {
      return jfa::sparse_gpu::backward(p, ws, stream, kernels);
    };
  };
  const double bwd_flops = 2.0 * c.topk * (3 * c.H + 2 * c.Hv) * c.N * c.T;
  // (The CUDA-core backward, minutes at this size, is not timed.)
  const double tc_bwd = time_ms(backward_with(jfa::sparse_gpu::BackwardKernels::kTensorCores), 10);
  printf("bench T %lld S %lld: backward tensor cores %.3f ms (%.1f TFLOP/s)\n", (long long)T, (long long)S, tc_bwd,
         bwd_flops / tc_bwd * 1e-9);
  const jfa::sparse_gpu::BackwardPasses hopper_passes = hopper_backward_passes(g);
  auto bench_passes = [&](const char* name, jfa::sparse_gpu::BackwardPasses passes) {
    const double ms = time_ms(
        [&](const SparseParams& p, cudaStream_t stream) {
          return jfa::sparse_gpu::backward(p, ws, stream, jfa::sparse_gpu::BackwardKernels::kTensorCores, passes);
        },
        10);
    printf("bench T %lld S %lld: backward %s %.3f ms (%.1f TFLOP/s)\n", (long long)T, (long long)S, name, ms,
           bwd_flops / ms * 1e-9);
  };
  if (hopper_passes.first) bench_passes("Hopper first pass", {hopper_passes.first});
  if (hopper_passes.second) bench_passes("Hopper second pass", {nullptr, hopper_passes.second});
  if (hopper_passes.first && hopper_passes.second) bench_passes("Hopper both passes", hopper_passes);
  // Each Hopper pass alone, chunk by chunk as backward() runs it, on what the runs above left in
  // the workspace; FLOPs of its own products (S, dP and dQ; the two products summed per row).
  auto bench_pass = [&](const char* name, double flops, auto&& launch) {
    const double ms = time_ms(
        [&](const SparseParams& p, cudaStream_t stream) {
          for (int64_t first = 0; first < c.T * c.K; first += bench_items)
            if (cudaError_t e = launch(p, first, std::min(bench_items, c.T * c.K - first), stream); e != cudaSuccess)
              return e;
          return cudaSuccess;
        },
        10);
    printf("bench T %lld S %lld: backward %s alone %.3f ms (%.1f TFLOP/s)\n", (long long)T, (long long)S, name, ms,
           flops / ms * 1e-9);
  };
  if (hopper_passes.first)
    bench_pass("Hopper first pass", 2.0 * c.topk * (2 * c.H + c.Hv) * c.N * c.T,
               [&](const SparseParams& p, int64_t first, int64_t count, cudaStream_t stream) {
                 return hopper_passes.first(p, ws.softmax_d, ws.weights, first, count, stream);
               });
  if (hopper_passes.second)
    bench_pass("Hopper second pass", 2.0 * c.topk * (c.H + c.Hv) * c.N * c.T,
               [&](const SparseParams& p, int64_t first, int64_t count, cudaStream_t stream) {
                 return hopper_passes.second(p, ws.weights, ws.dk_accum, first, count, stream);
               });
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "--bench") {
    bench(argc > 2 ? std::atoll(argv[2]) : 4096, argc > 3 ? std::atoll(argv[3]) : 32768);
    return 0;
  }
  const bool small = mode == "--small";
  const char* seed_env = std::getenv("JFA_CHECK_SEED");
  const unsigned seed = seed_env != nullptr ? unsigned(std::strtoul(seed_env, nullptr, 10)) : std::random_device{}();
  printf("seed: %u\n", seed);
  std::mt19937 rng(seed);
  const DType BF = DType::kBFloat16, FP = DType::kFloat16;
  // B, T, S, N, K, H, Hv, topk, shared value, causal, bottom-right, dtype, head_group.
  std::vector<Case> cases = {
      {1, 1, 9, 4, 1, 64, 64, 13, false, false, false, BF, 4},
      {2, 17, 70, 8, 2, 64, 48, 40, false, true, true, FP, 4},
      {1, 9, 5, 4, 4, 32, 32, 7, true, true, false, BF, 2},
      // 64 heads per CTA (attn_dist; the forward on CUDA cores: Hv 20), and MLA's dims with a
      // separate V.
      {1, 3, 90, 64, 1, 64, 20, 70, false, true, true, BF, 64},
      {1, 2, 100, 64, 1, 576, 512, 40, false, true, true, FP, 64},
      // MLA's shared latent rows: one block of valid slots (the pair's second empty), and two key
      // heads of 64 query heads each with a partial last pair.
      {1, 3, 100, 64, 1, 576, 512, 40, true, true, true, BF, 64},
      {2, 3, 200, 128, 2, 576, 512, 129, true, false, false, FP, 64},
      // topk 20: a single block in both Hopper backward passes (one 32-slot, one partial 64-slot).
      {1, 3, 100, 64, 1, 576, 512, 20, true, true, true, BF, 64},
      // The tensor-core backward's 64-head tiles (a group of 64 at H 128, V separate).
      {1, 4, 150, 64, 1, 128, 128, 90, false, true, true, BF, 64},
      // A group of 160: two head blocks (128 and 32) in the backward's dK/dV pass.
      {1, 2, 80, 160, 1, 64, 64, 70, false, true, true, BF, 32},
  };
  if (!small) {
    cases.push_back({1, 33, 300, 16, 1, 576, 512, 130, true, true, true, BF, 16});
    cases.push_back({2, 64, 64, 8, 2, 128, 128, 64, false, true, false, FP, 8});
    cases.push_back({1, 5, 2000, 128, 1, 576, 512, 2048, true, true, true, BF, 64});
    // A group of 32 in a 64-row tile; head groups spanning two CTAs (16-row and 64-row).
    cases.push_back({1, 7, 500, 32, 1, 128, 128, 100, false, true, true, BF, 32});
    cases.push_back({1, 3, 400, 128, 1, 576, 512, 300, true, true, true, FP, 128});
    // A head group of 128 over two key heads (two CTAs with different indices add into one row).
    cases.push_back({1, 3, 300, 128, 2, 576, 512, 150, true, false, false, BF, 128});
    // Padded dims (40 → 64, 192 / 128), and a head dim the tensor-core kernels do not take.
    cases.push_back({2, 5, 300, 8, 2, 40, 24, 77, false, false, false, BF, 4});
    cases.push_back({1, 6, 300, 16, 1, 192, 128, 129, false, true, true, BF, 16});
    cases.push_back({1, 4, 200, 4, 1, 36, 36, 50, true, true, false, FP, 4});
    // Dims padded to MLA's (264 / 136 → 576 / 512): dK's second column half and dV's warps past 136 idle.
    cases.push_back({1, 3, 120, 16, 1, 264, 136, 70, false, false, false, FP, 16});
    cases.push_back({1, 3, 300, 64, 1, 576, 512, 200, false, true, true, BF, 64});
  }
  for (const Case& c : cases) run_case(c, rng);
  printf("%zu cases, %d failures\n", cases.size(), g_failures);
  return g_failures ? 1 : 0;
}
