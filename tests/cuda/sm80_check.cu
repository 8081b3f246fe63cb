// The sm80 kernels checked from C++, without JAX: random inputs (a fresh seed each run), NaN-poisoned
// outputs, a double-precision CPU reference for o, lse, dq, dk, dv. Built and run by .ci/gpu-run,
// under compute-sanitizer (memcheck, racecheck) with --small.
// ./harness           correctness sweep + 16k timing
// ./harness --small   small correctness sweep only (for compute-sanitizer)
// ./harness --bench   timing only
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "jfa/params.h"
#include "sm80/api.h"

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      exit(2);                                                                                  \
    }                                                                                           \
  } while (0)

using jfa::AttentionParams;
using jfa::DType;

static float to_float(uint16_t h, DType dt) {
  if (dt == DType::kBFloat16) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  __half_raw r;
  r.x = h;
  return __half2float(__half(r));
}
static uint16_t from_float(float f, DType dt) {
  if (dt == DType::kBFloat16) {
    __nv_bfloat16 b = __float2bfloat16(f);
    uint16_t u;
    memcpy(&u, &b, 2);
    return u;
  }
  __half h = __float2half(f);
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}

struct Config {
  int B, T, S, N, K, H;
  bool causal;
  DType dt;
  bool dlse;
  int pad;  // extra elements per row (non-packed strides)
};

struct Tensor4 {  // host copy of a [B, rows, heads, H] tensor with row stride heads*H + pad
  int B, rows, heads, H, pad;
  std::vector<uint16_t> data;
  jfa::Strides strides() const {
    int64_t row = int64_t(heads) * H + pad;
    return jfa::Strides{row * rows, row, H};
  }
  size_t size() const { return size_t(B) * rows * (size_t(heads) * H + pad); }
  size_t idx(int b, int r, int h, int d) const {
    auto s = strides();
    return b * s.batch + r * s.row + h * s.head + d;
  }
};

static double rel_err(const std::vector<double>& out, const std::vector<double>& ref, double* max_abs, bool* finite) {
  double num = 0, den = 0;
  *max_abs = 0;
  *finite = true;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) *finite = false;
    double d = out[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    *max_abs = std::max(*max_abs, std::fabs(d));
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Double-precision reference over (b, n) pairs in parallel threads.
struct Ref {
  std::vector<double> o, lse, dq, dk, dv;
};

static Ref reference(const Config& c, const Tensor4& q, const Tensor4& k, const Tensor4& v, const Tensor4& dout,
                     const std::vector<float>& dlse, float scale) {
  Ref r;
  const int B = c.B, T = c.T, S = c.S, N = c.N, K = c.K, H = c.H, G = N / K;
  r.o.assign(size_t(B) * T * N * H, 0);
  r.lse.assign(size_t(B) * T * N, 0);
  r.dq.assign(size_t(B) * T * N * H, 0);
  r.dk.assign(size_t(B) * S * K * H, 0);
  r.dv.assign(size_t(B) * S * K * H, 0);
  // dk/dv are accumulated per query head then summed over the group: keep per-(b,n) buffers.
  std::vector<std::vector<double>> dk_part(size_t(B) * N), dv_part(size_t(B) * N);
  auto work = [&](int bn) {
    const int b = bn / N, n = bn % N, kh = n / G;
    std::vector<double> qd(size_t(T) * H), kd(size_t(S) * H), vd(size_t(S) * H), dod(size_t(T) * H);
    for (int t = 0; t < T; ++t)
      for (int d = 0; d < H; ++d) {
        qd[t * H + d] = to_float(q.data[q.idx(b, t, n, d)], c.dt);
        dod[t * H + d] = to_float(dout.data[dout.idx(b, t, n, d)], c.dt);
      }
    for (int s = 0; s < S; ++s)
      for (int d = 0; d < H; ++d) {
        kd[s * H + d] = to_float(k.data[k.idx(b, s, kh, d)], c.dt);
        vd[s * H + d] = to_float(v.data[v.idx(b, s, kh, d)], c.dt);
      }
    auto& dkp = dk_part[bn];
    auto& dvp = dv_part[bn];
    dkp.assign(size_t(S) * H, 0);
    dvp.assign(size_t(S) * H, 0);
    std::vector<double> p(S), dp(S), o(H);
    for (int t = 0; t < T; ++t) {
      const int smax = c.causal ? std::min(S, t + 1) : S;
      double m = -INFINITY;
      for (int s = 0; s < smax; ++s) {
        double acc = 0;
        for (int d = 0; d < H; ++d) acc += qd[t * H + d] * kd[s * H + d];
        p[s] = acc * scale;
        m = std::max(m, p[s]);
      }
      double l = 0;
      for (int s = 0; s < smax; ++s) l += (p[s] = std::exp(p[s] - m));
      for (int s = 0; s < smax; ++s) p[s] /= l;
      const size_t orow = ((size_t(b) * T + t) * N + n);
      r.lse[orow] = m + std::log(l);
      std::fill(o.begin(), o.end(), 0);
      for (int s = 0; s < smax; ++s)
        for (int d = 0; d < H; ++d) o[d] += p[s] * vd[s * H + d];
      for (int d = 0; d < H; ++d) r.o[orow * H + d] = o[d];
      // Backward.
      double Dsum = 0;
      for (int d = 0; d < H; ++d) Dsum += dod[t * H + d] * o[d];
      const double g = c.dlse ? dlse[orow] : 0.0;
      for (int s = 0; s < smax; ++s) {
        double acc = 0;
        for (int d = 0; d < H; ++d) acc += dod[t * H + d] * vd[s * H + d];
        dp[s] = p[s] * (acc - Dsum + g);  // dS
      }
      for (int s = 0; s < smax; ++s)
        for (int d = 0; d < H; ++d) {
          r.dq[orow * H + d] += scale * dp[s] * kd[s * H + d];
          dkp[s * H + d] += scale * dp[s] * qd[t * H + d];
          dvp[s * H + d] += p[s] * dod[t * H + d];
        }
    }
  };
  const int jobs = B * N;
  const int nthreads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int w = 0; w < nthreads; ++w)
    pool.emplace_back([&, w] {
      for (int j = w; j < jobs; j += nthreads) work(j);
    });
  for (auto& th : pool) th.join();
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n) {
      const int kh = n / G;
      for (int s = 0; s < S; ++s)
        for (int d = 0; d < H; ++d) {
          size_t i = ((size_t(b) * S + s) * K + kh) * H + d;
          r.dk[i] += dk_part[b * N + n][s * H + d];
          r.dv[i] += dv_part[b * N + n][s * H + d];
        }
    }
  return r;
}

static void fill(Tensor4& t, std::mt19937& rng, DType dt) {
  std::normal_distribution<float> nd(0.f, 1.f);
  t.data.resize(t.size());
  for (auto& x : t.data) x = from_float(nd(rng), dt);
}

static void* upload(const std::vector<uint16_t>& h) {
  void* d;
  CK(cudaMalloc(&d, h.size() * 2 + 16));
  CK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return d;
}

static int g_failures = 0;

static void run_case(const Config& c, std::mt19937& rng) {
  const char* dtn = c.dt == DType::kBFloat16 ? "bf16" : "fp16";
  if (!jfa::sm80::is_built(c.dt, c.H)) {
    printf("SKIP (not built) %s H=%d\n", dtn, c.H);
    return;
  }
  Tensor4 q{c.B, c.T, c.N, c.H, c.pad}, k{c.B, c.S, c.K, c.H, c.pad}, v{c.B, c.S, c.K, c.H, c.pad},
      dout{c.B, c.T, c.N, c.H, c.pad};
  fill(q, rng, c.dt);
  fill(k, rng, c.dt);
  fill(v, rng, c.dt);
  fill(dout, rng, c.dt);
  std::vector<float> dlse(size_t(c.B) * c.T * c.N);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : dlse) x = nd(rng);
  const float scale = 1.f / std::sqrt(float(c.H));

  AttentionParams p;
  p.B = c.B; p.T = c.T; p.S = c.S; p.N = c.N; p.K = c.K; p.H = c.H; p.Hv = c.H;
  p.dtype = c.dt;
  p.scale = scale;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.is_causal = c.causal;
  p.q = upload(q.data); p.k = upload(k.data); p.v = upload(v.data);
  p.q_strides = q.strides(); p.k_strides = k.strides(); p.v_strides = v.strides();
  Tensor4 o_layout{c.B, c.T, c.N, c.H, c.pad};
  const size_t o_elems = o_layout.size();
  void *d_o, *d_dq, *d_dk, *d_dv;
  CK(cudaMalloc(&d_o, o_elems * 2)); CK(cudaMalloc(&d_dq, o_elems * 2));
  CK(cudaMalloc(&d_dk, k.size() * 2)); CK(cudaMalloc(&d_dv, v.size() * 2));
  // Poison outputs with NaN (0xFFFF is NaN in both fp16 and bf16).
  CK(cudaMemset(d_o, 0xFF, o_elems * 2)); CK(cudaMemset(d_dq, 0xFF, o_elems * 2));
  CK(cudaMemset(d_dk, 0xFF, k.size() * 2)); CK(cudaMemset(d_dv, 0xFF, v.size() * 2));
  float *d_lse, *d_dlse, *d_dqacc, *d_D;
  const size_t rows = size_t(c.B) * c.T * c.N;
  CK(cudaMalloc(&d_lse, rows * 4)); CK(cudaMemset(d_lse, 0xFF, rows * 4));
  CK(cudaMalloc(&d_dlse, rows * 4));
  CK(cudaMemcpy(d_dlse, dlse.data(), rows * 4, cudaMemcpyHostToDevice));
  const size_t acc_elems = size_t(c.B) * c.N * ((c.T + jfa::kDqAccumRowAlign - 1) / jfa::kDqAccumRowAlign) *
                           jfa::kDqAccumRowAlign * c.H;  // padded rows (params.h)
  CK(cudaMalloc(&d_dqacc, acc_elems * 4)); CK(cudaMemset(d_dqacc, 0xFF, acc_elems * 4));
  CK(cudaMalloc(&d_D, rows * 4)); CK(cudaMemset(d_D, 0xFF, rows * 4));
  p.o = d_o; p.o_strides = o_layout.strides();
  p.lse = d_lse; p.lse_strides = jfa::Strides{int64_t(c.T) * c.N, c.N, 1};
  p.dout = upload(dout.data); p.do_strides = dout.strides();
  p.dlse = c.dlse ? d_dlse : nullptr;
  p.dq = d_dq; p.dq_strides = o_layout.strides();
  p.dk = d_dk; p.dk_strides = k.strides();
  p.dv = d_dv; p.dv_strides = v.strides();
  p.dq_accum = d_dqacc; p.softmax_d = d_D;

  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  CK(jfa::sm80::forward(p, stream));
  CK(jfa::sm80::backward(p, stream));
  CK(cudaStreamSynchronize(stream));

  std::vector<uint16_t> h_o(o_elems), h_dq(o_elems), h_dk(k.size()), h_dv(v.size());
  std::vector<float> h_lse(rows);
  CK(cudaMemcpy(h_o.data(), d_o, o_elems * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_dq.data(), d_dq, o_elems * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_dk.data(), d_dk, k.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_dv.data(), d_dv, v.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_lse.data(), d_lse, rows * 4, cudaMemcpyDeviceToHost));

  Ref ref = reference(c, q, k, v, dout, dlse, scale);
  auto gather = [&](const std::vector<uint16_t>& h, const Tensor4& lay) {
    std::vector<double> out;
    out.reserve(size_t(lay.B) * lay.rows * lay.heads * lay.H);
    for (int b = 0; b < lay.B; ++b)
      for (int r = 0; r < lay.rows; ++r)
        for (int hh = 0; hh < lay.heads; ++hh)
          for (int d = 0; d < lay.H; ++d) out.push_back(to_float(h[lay.idx(b, r, hh, d)], c.dt));
    return out;
  };
  std::vector<double> o = gather(h_o, o_layout), dq = gather(h_dq, o_layout), dk = gather(h_dk, k),
                      dv = gather(h_dv, v), lse(h_lse.begin(), h_lse.end());
  const double tol = c.dt == DType::kBFloat16 ? 2e-2 : 3e-3;
  double ma[5];
  bool fin[5];
  double e[5] = {rel_err(o, ref.o, &ma[0], &fin[0]), rel_err(lse, ref.lse, &ma[1], &fin[1]),
                 rel_err(dq, ref.dq, &ma[2], &fin[2]), rel_err(dk, ref.dk, &ma[3], &fin[3]),
                 rel_err(dv, ref.dv, &ma[4], &fin[4])};
  const double tols[5] = {tol, 1e-4, 4 * tol, 4 * tol, 4 * tol};
  // Relative L2 error, or (when the reference is ~0, e.g. dS == 0 exactly for T = 1 causal, where
  // only the fp16/bf16 rounding of O in D remains) a small absolute error.
  const double abs_tol = 4 * tol;
  bool ok = true;
  for (int i = 0; i < 5; ++i) ok = ok && fin[i] && (e[i] <= tols[i] || ma[i] <= abs_tol);
  if (!ok) ++g_failures;
  printf("%s %s B=%d T=%d S=%d N=%d K=%d H=%d causal=%d dlse=%d pad=%d | rel o %.2e lse %.2e dq %.2e dk %.2e dv %.2e | maxabs dq %.1e dk %.1e%s\n",
         ok ? "PASS" : "FAIL", dtn, c.B, c.T, c.S, c.N, c.K, c.H, c.causal, c.dlse, c.pad, e[0], e[1], e[2], e[3], e[4], ma[2], ma[3],
         (fin[0] && fin[1] && fin[2] && fin[3] && fin[4]) ? "" : " NONFINITE");
  fflush(stdout);
  CK(cudaStreamDestroy(stream));
  for (void* ptr : {(void*)p.q, (void*)p.k, (void*)p.v, (void*)p.dout, d_o, d_dq, d_dk, d_dv, (void*)d_lse, (void*)d_dlse,
                    (void*)d_dqacc, (void*)d_D})
    CK(cudaFree(ptr));
}

static void bench(DType dt, int H, int B, int T, int N, bool causal) {
  if (!jfa::sm80::is_built(dt, H)) return;
  const int S = T, K = N;
  AttentionParams p;
  p.B = B; p.T = T; p.S = S; p.N = N; p.K = K; p.H = H; p.Hv = H; p.dtype = dt;
  p.scale = 1.f / std::sqrt(float(H));
  p.scale_log2 = p.scale * 1.4426950408889634f;
  p.is_causal = causal;
  const size_t n = size_t(B) * T * N * H, rows = size_t(B) * T * N;
  std::vector<uint16_t> h(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : h) x = from_float(nd(rng), dt);
  void* bufs[8];
  for (int i = 0; i < 8; ++i) bufs[i] = upload(h);
  float *lse, *dqacc, *D;
  const size_t acc_rows = size_t(B) * N * ((T + jfa::kDqAccumRowAlign - 1) / jfa::kDqAccumRowAlign) * jfa::kDqAccumRowAlign;
  CK(cudaMalloc(&lse, rows * 4)); CK(cudaMalloc(&dqacc, acc_rows * H * 4)); CK(cudaMalloc(&D, rows * 4));
  auto st = jfa::packed_strides(T, N, H);
  p.q = bufs[0]; p.k = bufs[1]; p.v = bufs[2]; p.o = bufs[3]; p.dout = bufs[4];
  p.dq = bufs[5]; p.dk = bufs[6]; p.dv = bufs[7];
  p.q_strides = p.k_strides = p.v_strides = p.o_strides = p.do_strides = p.dq_strides = p.dk_strides = p.dv_strides = st;
  p.lse = lse; p.lse_strides = jfa::Strides{int64_t(T) * N, N, 1};
  p.dq_accum = dqacc; p.softmax_d = D;
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto time = [&](bool bwd) {
    for (int i = 0; i < 3; ++i) CK(bwd ? jfa::sm80::backward(p, s) : jfa::sm80::forward(p, s));
    std::vector<float> ms;
    for (int r = 0; r < 10; ++r) {
      CK(cudaEventRecord(e0, s));
      CK(bwd ? jfa::sm80::backward(p, s) : jfa::sm80::forward(p, s));
      CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1));
      float t;
      CK(cudaEventElapsedTime(&t, e0, e1));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  CK(jfa::sm80::forward(p, s));
  const float tf = time(false), tb = time(true);
  double flops = 4.0 * B * double(T) * S * N * H * (causal ? 0.5 : 1.0);
  printf("BENCH %s H=%d B=%d T=S=%d N=%d causal=%d | fwd %.3f ms %.1f TFLOP/s | bwd %.3f ms %.1f TFLOP/s | fwd+bwd %.1f TFLOP/s\n",
         dt == DType::kBFloat16 ? "bf16" : "fp16", H, B, T, N, causal, tf, flops / tf * 1e-9, tb, 2.5 * flops / tb * 1e-9,
         3.5 * flops / (tf + tb) * 1e-9);
  fflush(stdout);
  for (int i = 0; i < 8; ++i) CK(cudaFree(bufs[i]));
  CK(cudaFree(lse)); CK(cudaFree(dqacc)); CK(cudaFree(D));
  CK(cudaStreamDestroy(s));
}

int main(int argc, char** argv) {
  const bool small = argc > 1 && std::string(argv[1]) == "--small";
  const bool bench_only = argc > 1 && std::string(argv[1]) == "--bench";
  printf("built: %s\n", jfa::sm80::built_variants());
  const unsigned seed = std::random_device{}();
  printf("seed: %u\n", seed);
  std::mt19937 rng(seed);
  std::vector<Config> cases;
  const DType BF = DType::kBFloat16, FP = DType::kFloat16;
  if (small) {
    for (int H : {64, 128})
      for (bool causal : {false, true}) {
        cases.push_back({1, 17, 17, 2, 1, H, causal, BF, true, 0});
        cases.push_back({1, 70, 130, 2, 2, H, causal, FP, false, 8});
        cases.push_back({1, 130, 65, 4, 2, H, causal, BF, true, 0});
      }
    for (int H : {32, 96, 192, 256}) cases.push_back({1, 70, 90, 2, 1, H, true, BF, true, 0});
  } else if (!bench_only) {
    const int TS[][2] = {{1, 1}, {17, 17}, {255, 255}, {1000, 1000}, {17, 255}, {255, 17}, {1000, 255}, {1, 1000}, {255, 1}};
    for (DType dt : {BF, FP})
      for (int H : {64, 128})
        for (bool causal : {false, true})
          for (auto& ts : TS) {
            const bool big = ts[0] >= 1000 || ts[1] >= 1000;
            cases.push_back({big ? 1 : 2, ts[0], ts[1], 2, 2, H, causal, dt, (ts[0] + ts[1]) % 2 == 0, 0});
          }
    for (bool causal : {false, true}) {
      cases.push_back({2, 255, 1000, 8, 2, 128, causal, BF, true, 0});    // GQA
      cases.push_back({1, 1000, 255, 8, 1, 64, causal, FP, true, 0});     // MQA
      cases.push_back({2, 255, 255, 4, 2, 128, causal, BF, true, 8});     // non-packed strides
    }
    for (int H : {32, 96, 192, 256})
      for (bool causal : {false, true})
        for (DType dt : {BF, FP}) cases.push_back({2, 255, 300, 2, 1, H, causal, dt, true, 0});
  }
  for (auto& c : cases) run_case(c, rng);
  if (!small) {
    bench(BF, 128, 1, 16384, 16, false);
    bench(BF, 128, 1, 16384, 16, true);
    bench(BF, 64, 1, 16384, 32, false);
    bench(BF, 256, 1, 16384, 8, false);
  }
  printf("%d failures\n", g_failures);
  return g_failures ? 1 : 0;
}
