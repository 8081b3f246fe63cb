// The sm80 kernels checked from C++, without JAX: random inputs (a fresh seed each run), NaN-poisoned
// outputs, a double-precision CPU reference for o, lse, dq, dk, dv. Built and run by .ci/gpu-run,
// under compute-sanitizer (memcheck, racecheck) with --small. Built with -DJFA_CHECK_SM90 (and the
// sm90 library) it also runs the Hopper backward on every case it takes (sm90/api.h,
// can_implement_backward), against the same reference, on a compute capability 9.0 device; the
// timings then include it.
// ./harness           correctness sweep + 16k timing
// ./harness --small   small correctness sweep only (for compute-sanitizer); --small --hopper-only
//                     only its cases the Hopper backward takes, without the portable backward
// ./harness --bench   timing only; --bench H CAUSAL times one problem (bf16, 16k; for A/B runs
//                     and ncu: benchmarks/ab_sm80.sh)
// ./harness --bench-hopper H CAUSAL [T [N K]]   the Hopper backward alone on one problem (bf16,
//                     B·T = 16k, default T 16k and N·H = 2048, K = N; for A/B runs and ncu: its
//                     4th launch is the first timed one)
// Cases with a feature name (lengths, window, bottom_right, segments, softcap, alibi, bias*, mask,
// dropout, all, empty) run the kernels' general path (jfa/mask.h policies); the reference computes
// logits, softcap, bias, ALiBi and the softmax in double, sharing with the kernels only the position
// and data predicate visible() and the Philox dropout words (which must be bit-identical). It also
// checks d(bias), and that jfa::query_range / key_range never miss a visible element.
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

#include "check_util.h"
#include "jfa/mask.h"
#include "jfa/params.h"
#include "jfa/philox.h"
#include "sm80/api.h"
#ifdef JFA_CHECK_SM90
#include "sm90/api.h"
#endif

using jfa::AttentionParams;
using jfa::DType;

// Masking features of a case (all off: the plain/causal kernels).
struct Features {
  const char* name = nullptr;
  bool bottom_right = false;
  int window_left = -1, window_right = -1;
  bool q_lengths = false, kv_lengths = false, empty_batch = false;  // empty: batch 1 has kv length 0
  bool segments = false;
  float softcap = 0.f;
  bool alibi = false;
  int bias = 0;  // 0: none; 1: [B, N, T, S]; 2: [1, N, 1, S]; 3: [B, 1, T, 1]
  bool mask = false;  // [B, 1, T, S]: empty, full and mixed tiles, so every tile kind is exercised
  float dropout = 0.f;
  bool deterministic = false;  // ordered dQ adds; the backward runs twice and dq must match bitwise
};

struct Config {
  int B, T, S, N, K, H;
  bool causal;
  DType dt;
  bool dlse;
  int pad;  // extra elements per row (non-packed strides)
  Features f = {};
};

// Host copies of the feature operands; AttentionParams::mask of the host copy points into them.
struct FeatureData {
  std::vector<int32_t> q_len, kv_len, q_seg, kv_seg, q_chunks, kv_chunks;  // chunks: segment summaries
  std::vector<float> bias, slopes;
  PackedMaskHost mask;
  std::vector<uint32_t> seeds;
  int64_t bias_dims[4] = {0, 0, 0, 0};
  jfa::Strides4 bias_strides;
};

static FeatureData make_features(const Config& c, std::mt19937& rng) {
  FeatureData d;
  const Features& f = c.f;
  std::uniform_int_distribution<int> coin(0, 999);
  if (f.q_lengths)
    for (int b = 0; b < c.B; ++b) d.q_len.push_back(b % 2 == 0 ? c.T - c.T / 3 : coin(rng) % (c.T + 1));
  if (f.kv_lengths || f.empty_batch)
    for (int b = 0; b < c.B; ++b)
      d.kv_len.push_back(f.empty_batch && b == 1 ? 0 : b % 2 == 0 ? c.S - c.S / 4 : coin(rng) % (c.S + 1));
  if (f.segments)
    for (int b = 0; b < c.B; ++b) {
      // Three packed sequences in proportion, plus one stray id to make a tile partial.
      for (int i = 0; i < c.T; ++i) d.q_seg.push_back(int64_t(i) * 3 / c.T + b);
      for (int j = 0; j < c.S; ++j) d.kv_seg.push_back(int64_t(j) * 3 / c.S + b);
      if (c.S > 5) d.kv_seg[size_t(b) * c.S + 5] = 7;
    }
  if (f.segments) {
    d.q_chunks = segment_chunks(d.q_seg, c.T, d.kv_seg, c.S, c.B);
    d.kv_chunks = segment_chunks(d.kv_seg, c.S, d.q_seg, c.T, c.B);
  }
  std::normal_distribution<float> nd(0.f, 1.f);
  if (f.bias) {
    const int64_t full[4] = {c.B, c.N, c.T, c.S};
    const bool keep[3][4] = {{1, 1, 1, 1}, {0, 1, 0, 1}, {1, 0, 1, 0}};
    for (int a = 0; a < 4; ++a) d.bias_dims[a] = keep[f.bias - 1][a] ? full[a] : 1;
    const int64_t* e = d.bias_dims;
    d.bias_strides = jfa::broadcast_strides(e);
    d.bias.resize(size_t(e[0] * e[1] * e[2] * e[3]));
    for (auto& x : d.bias) x = nd(rng);
  }
  if (f.alibi)  // [B, N]: a per-batch slope exercises the batch stride
    for (int i = 0; i < c.B * c.N; ++i) d.slopes.push_back(0.02f + 0.3f * float(coin(rng)) / 1000.f);
  if (f.mask) {
    std::vector<uint8_t> mask = tiled_random_mask(c.B, c.T, c.S, 800, rng);
    if (c.T > 3)
      for (int j = 0; j < c.S; ++j) mask[size_t(3) * c.S + j] = 0;  // batch 0, row 3: nothing visible
    d.mask = pack_mask_host(mask, c.B, c.T, c.S);
  }
  if (f.dropout > 0.f)
    for (int i = 0; i < 3 * c.B; ++i) d.seeds.push_back(uint32_t(rng()));
  return d;
}

// The features into p.mask, pointing at `ptr(vector)` (host or device copies).
template <typename Ptr>
static void set_features(const Config& c, const FeatureData& d, AttentionParams* p, Ptr ptr) {
  jfa::MaskParams& m = p->mask;
  m = jfa::MaskParams{};
  m.bottom_right = c.f.bottom_right;
  m.window_left = c.f.window_left;
  m.window_right = c.f.window_right;
  m.softcap = c.f.softcap;
  m.dropout_rate = c.f.dropout;
  if (!d.q_len.empty()) m.q_lengths = static_cast<const int32_t*>(ptr(d.q_len));
  if (!d.kv_len.empty()) m.kv_lengths = static_cast<const int32_t*>(ptr(d.kv_len));
  if (!d.q_seg.empty()) {
    m.q_segment_ids = static_cast<const int32_t*>(ptr(d.q_seg));
    m.kv_segment_ids = static_cast<const int32_t*>(ptr(d.kv_seg));
    m.q_segment_chunks = static_cast<const int32_t*>(ptr(d.q_chunks));
    m.kv_segment_chunks = static_cast<const int32_t*>(ptr(d.kv_chunks));
  }
  if (!d.bias.empty()) {
    m.bias = static_cast<const float*>(ptr(d.bias));
    m.bias_strides = d.bias_strides;
    for (int a = 0; a < 4; ++a) m.bias_dims[a] = d.bias_dims[a];
  }
  if (!d.slopes.empty()) {
    m.alibi_slopes = static_cast<const float*>(ptr(d.slopes));
    m.alibi_batch_stride = c.N;
  }
  if (!d.mask.bits.empty())
    m.packed_mask = packed_mask_view(static_cast<const uint32_t*>(ptr(d.mask.bits)),
                                     static_cast<const uint8_t*>(ptr(d.mask.tiles)), c.T, c.S);
  if (!d.seeds.empty()) m.dropout_seeds = static_cast<const uint32_t*>(ptr(d.seeds));
}

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
  std::vector<double> o, lse, dq, dk, dv, dbias, dslopes;  // dslopes [B, N]
  std::vector<double> dslopes_l1;  // sum of |dS·|pos - j|| per [B, N]: the scale of d(slope)'s terms
};

// `hp`: the call's parameters with host pointers (only is_causal, shapes and hp.mask are read).
static Ref reference(const Config& c, const Tensor4& q, const Tensor4& k, const Tensor4& v, const Tensor4& dout,
                     const std::vector<float>& dlse, float scale, const AttentionParams& hp) {
  Ref r;
  const jfa::MaskParams& fm = hp.mask;
  const bool general = fm.active();
  // d(logit) of every element, for d(bias) (reduced to the bias's shape at the end).
  std::vector<double> ds_full(fm.bias != nullptr ? size_t(c.B) * c.N * c.T * c.S : 0);
  const int B = c.B, T = c.T, S = c.S, N = c.N, K = c.K, H = c.H, G = N / K;
  r.o.assign(size_t(B) * T * N * H, 0);
  r.lse.assign(size_t(B) * T * N, 0);
  r.dq.assign(size_t(B) * T * N * H, 0);
  r.dk.assign(size_t(B) * S * K * H, 0);
  r.dv.assign(size_t(B) * S * K * H, 0);
  r.dslopes.assign(fm.alibi_slopes != nullptr ? size_t(B) * N : 0, 0);
  r.dslopes_l1.assign(r.dslopes.size(), 0);
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
    std::vector<double> p(S), dp(S), o(H), sg(S, 1.0), z(S, 1.0);
    std::vector<char> vis(S, 1);
    const jfa::SequenceBounds sb = jfa::sequence_bounds(hp, b);
    const double keep_scale = 1.0 / (1.0 - double(fm.dropout_rate));
    for (int t = 0; t < T; ++t) {
      const int smax = general ? S : c.causal ? std::min(S, t + 1) : S;
      double m = -INFINITY;
      for (int s = 0; s < smax; ++s) {
        if (general) {
          vis[s] = jfa::visible(hp, sb, b, n, t, s);
          if (!vis[s]) continue;
        }
        double acc = 0;
        for (int d = 0; d < H; ++d) acc += qd[t * H + d] * kd[s * H + d];
        double x = acc * scale;
        if (fm.softcap > 0.f) {
          const double th = std::tanh(x / fm.softcap);
          x = fm.softcap * th;
          sg[s] = 1.0 - th * th;
        }
        if (fm.bias != nullptr) {
          const jfa::Strides4& st = fm.bias_strides;
          x += fm.bias[b * st.batch + n * st.head + t * st.row + s * st.col];
        }
        if (fm.alibi_slopes != nullptr)
          x -= double(fm.alibi_slopes[b * fm.alibi_batch_stride + n]) * std::fabs(double(t + sb.offset - s));
        if (fm.dropout_rate > 0.f) {
          const uint32_t* seed = fm.dropout_seeds + 3 * b;
          const uint32_t w = jfa::dropout_uniform(seed[0], seed[1], seed[2], n, t, s);
          z[s] = w < jfa::dropout_threshold(fm.dropout_rate) ? 0.0 : keep_scale;
        }
        p[s] = x;
        m = std::max(m, p[s]);
      }
      const size_t orow = ((size_t(b) * T + t) * N + n);
      std::fill(o.begin(), o.end(), 0);
      if (m == -INFINITY) {  // nothing visible: o = 0, lse = -inf, no gradient
        r.lse[orow] = -INFINITY;
        continue;
      }
      double l = 0;
      for (int s = 0; s < smax; ++s) l += vis[s] ? (p[s] = std::exp(p[s] - m)) : (p[s] = 0.0);
      for (int s = 0; s < smax; ++s) p[s] /= l;
      r.lse[orow] = m + std::log(l);
      for (int s = 0; s < smax; ++s)
        for (int d = 0; d < H; ++d) o[d] += p[s] * z[s] * vd[s * H + d];
      for (int d = 0; d < H; ++d) r.o[orow * H + d] = o[d];
      // Backward.
      double Dsum = 0;
      for (int d = 0; d < H; ++d) Dsum += dod[t * H + d] * o[d];
      const double g = c.dlse ? dlse[orow] : 0.0;
      for (int s = 0; s < smax; ++s) {
        double acc = 0;
        for (int d = 0; d < H; ++d) acc += dod[t * H + d] * vd[s * H + d];
        dp[s] = p[s] * (acc * z[s] - Dsum + g);  // dS (d of the final logit)
        if (!ds_full.empty()) ds_full[((size_t(b) * N + n) * T + t) * S + s] = dp[s];
        if (!r.dslopes.empty()) {
          r.dslopes[bn] -= dp[s] * std::fabs(double(t + sb.offset - s));
          r.dslopes_l1[bn] += std::fabs(dp[s] * double(t + sb.offset - s));
        }
        dp[s] *= sg[s];  // through soft-capping
      }
      for (int s = 0; s < smax; ++s)
        for (int d = 0; d < H; ++d) {
          r.dq[orow * H + d] += scale * dp[s] * kd[s * H + d];
          dkp[s * H + d] += scale * dp[s] * qd[t * H + d];
          dvp[s * H + d] += p[s] * z[s] * dod[t * H + d];
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
  if (fm.bias != nullptr) {
    const int64_t* e = fm.bias_dims;
    r.dbias.assign(size_t(e[0] * e[1] * e[2] * e[3]), 0.0);
    const jfa::Strides4& st = fm.bias_strides;
    for (int b = 0; b < B; ++b)
      for (int n = 0; n < N; ++n)
        for (int t = 0; t < T; ++t)
          for (int s = 0; s < S; ++s)
            r.dbias[b * st.batch + n * st.head + t * st.row + s * st.col] +=
                ds_full[((size_t(b) * N + n) * T + t) * S + s];
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

template <typename T>
static void* upload_vec(const std::vector<T>& h) {
  void* d;
  CK(cudaMalloc(&d, h.size() * sizeof(T) + 16));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// The key range of every query block and the query range of every key block (the kernels' trip
// counts) must contain every visible element; returns the number of misses.
static int check_ranges(const Config& c, const AttentionParams& hp) {
  int misses = 0;
  for (int b = 0; b < c.B; ++b) {
    const jfa::SequenceBounds sb = jfa::sequence_bounds(hp, b);
    for (int blk : {64, 128})
      for (int t = 0; t < c.T; ++t)
        for (int s = 0; s < c.S; ++s) {
          if (!jfa::visible(hp, sb, b, 0, t, s)) continue;
          const jfa::KeyRange kr = jfa::key_range(hp, sb, t / blk * blk, blk);
          const jfa::KeyRange qr = jfa::query_range(hp, sb, s / blk * blk, blk);
          if (s < kr.begin || s >= kr.end || t < qr.begin || t >= qr.end) ++misses;
        }
  }
  return misses;
}

static int g_failures = 0;
static bool g_hopper_only = false;  // --hopper-only: the portable backward neither runs nor is checked

// Whether the current device is a compute capability 9.0 one (the Hopper kernels run there only).
static bool hopper_device() {
  int device = 0, major = 0, minor = 0;
  CK(cudaGetDevice(&device));
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
}

// Columns of a row of the backward's float32 workspace, as the lowering allocates them: wider
// than H where the Hopper backward runs H on its next larger kernel (sm90/api.h).
static int64_t accum_cols(int H) {
#ifdef JFA_CHECK_SM90
  return jfa::sm90::workspace_head_dim(H);
#else
  return H;
#endif
}

static void run_case(const Config& c, std::mt19937& rng) {
  const char* dtn = c.dt == DType::kBFloat16 ? "bf16" : "fp16";
  if (!jfa::sm80::is_built(c.dt, c.H)) {
    printf("SKIP (not built) %s H=%d\n", dtn, c.H);
    return;
  }
  // The Hopper backward's head dims, and no masking feature.
  if (g_hopper_only && (c.f.name != nullptr || !(c.H == 64 || c.H == 128 || c.H == 256))) return;
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
  // Features: device copies for the kernels, host copies for the reference.
  const FeatureData fd = make_features(c, rng);
  std::vector<void*> feature_bufs;
  set_features(c, fd, &p, [&](const auto& vec) {
    feature_bufs.push_back(upload_vec(vec));
    return feature_bufs.back();
  });
  AttentionParams hp = p;
  set_features(c, fd, &hp, [](const auto& vec) { return static_cast<const void*>(vec.data()); });
  float* d_dbias = nullptr;
  if (!fd.bias.empty()) {
    CK(cudaMalloc(&d_dbias, fd.bias.size() * 4));
    CK(cudaMemset(d_dbias, 0xFF, fd.bias.size() * 4));  // NaN: run_bwd must zero it
    p.mask.dbias = d_dbias;  // in the bias's own shape (the FFI's full-shape one: tests/test_gpu.py)
    for (int a = 0; a < 4; ++a) p.mask.dbias_dims[a] = p.mask.bias_dims[a];
    p.mask.dbias_strides = jfa::broadcast_strides(p.mask.bias_dims);
  }
  // d(ALiBi slopes): partial sums per 64 keys, poisoned with NaN (run_bwd must zero them).
  float* d_dslopes = nullptr;
  const int dslope_slots = (c.S + jfa::kDslopeKeys - 1) / jfa::kDslopeKeys;
  if (!fd.slopes.empty()) {
    const size_t count = size_t(c.B) * c.N * dslope_slots;
    CK(cudaMalloc(&d_dslopes, count * 4));
    CK(cudaMemset(d_dslopes, 0xFF, count * 4));
    p.mask.dslopes = d_dslopes;
    p.mask.dslope_slots = dslope_slots;
  }
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
  p.accum_cols = accum_cols(c.H);
  const size_t acc_elems = size_t(jfa::kDqLanes) * c.B * c.N * p.dq_accum_rows() * p.accum_cols;  // every lane
  CK(cudaMalloc(&d_dqacc, acc_elems * 4)); CK(cudaMemset(d_dqacc, 0xFF, acc_elems * 4));
  const size_t stat_rows = size_t(c.B) * c.N * p.dq_accum_rows();  // params.h: softmax_d, lse_log2
  CK(cudaMalloc(&d_D, 2 * stat_rows * 4)); CK(cudaMemset(d_D, 0xFF, 2 * stat_rows * 4));
  p.o = d_o; p.o_strides = o_layout.strides();
  p.lse = d_lse; p.lse_strides = jfa::Strides{int64_t(c.T) * c.N, c.N, 1};
  p.dout = upload(dout.data); p.do_strides = dout.strides();
  p.dlse = c.dlse ? d_dlse : nullptr;
  p.dq = d_dq; p.dq_strides = o_layout.strides();
  p.dk = d_dk; p.dk_strides = k.strides();
  p.dv = d_dv; p.dv_strides = v.strides();
  p.dq_accum = d_dqacc; p.softmax_d = d_D;
  float* d_dkvacc = nullptr;  // GQA's dK and dV partial sums (params.h), as the lowering gives them
  if (c.N > c.K && !c.f.deterministic) {
    const size_t elems = size_t(2) * c.B * c.K * p.dkv_accum_rows() * p.accum_cols;
    CK(cudaMalloc(&d_dkvacc, elems * 4));
    CK(cudaMemset(d_dkvacc, 0xFF, elems * 4));  // the launcher must zero it
    p.dkv_accum = d_dkvacc;
  }
  int32_t* d_sem = nullptr;
  if (c.f.deterministic) {
    const size_t sems = size_t(jfa::kDqLanes) * c.B * c.N * p.dq_semaphores_per_head();
    CK(cudaMalloc(&d_sem, sems * 4));
    CK(cudaMemset(d_sem, 0xFF, sems * 4));  // the launcher must zero it
    p.deterministic = true;
    p.dq_semaphore = d_sem;
  }

  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  CK(jfa::sm80::forward(p, stream));
  if (!g_hopper_only) CK(jfa::sm80::backward(p, stream));
  CK(cudaStreamSynchronize(stream));
  // Deterministic: a second backward gives the same dq bits.
  bool reproducible = true;
  if (c.f.deterministic) {
    std::vector<uint16_t> first(o_elems), second(o_elems);
    CK(cudaMemcpy(first.data(), d_dq, o_elems * 2, cudaMemcpyDeviceToHost));
    CK(jfa::sm80::backward(p, stream));
    CK(cudaStreamSynchronize(stream));
    CK(cudaMemcpy(second.data(), d_dq, o_elems * 2, cudaMemcpyDeviceToHost));
    reproducible = std::memcmp(first.data(), second.data(), o_elems * 2) == 0;
  }

  std::vector<uint16_t> h_o(o_elems), h_dq(o_elems), h_dk(k.size()), h_dv(v.size());
  std::vector<float> h_lse(rows);
  CK(cudaMemcpy(h_o.data(), d_o, o_elems * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_dq.data(), d_dq, o_elems * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_dk.data(), d_dk, k.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_dv.data(), d_dv, v.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_lse.data(), d_lse, rows * 4, cudaMemcpyDeviceToHost));
  // d(bias) (the bias's shape) and d(slopes) (summed over each head's slots) as the last backward
  // left them: the portable backward's now, the Hopper backward's after it ran.
  auto read_dbias = [&]() {
    std::vector<double> out;
    if (d_dbias == nullptr) return out;
    std::vector<float> h(fd.bias.size());
    CK(cudaMemcpy(h.data(), d_dbias, h.size() * 4, cudaMemcpyDeviceToHost));
    out.assign(h.begin(), h.end());
    return out;
  };
  auto read_dslopes = [&]() {
    std::vector<double> out;
    if (d_dslopes == nullptr) return out;
    std::vector<float> h(size_t(c.B) * c.N * dslope_slots);
    CK(cudaMemcpy(h.data(), d_dslopes, h.size() * 4, cudaMemcpyDeviceToHost));
    out.assign(size_t(c.B) * c.N, 0.0);
    for (size_t i = 0; i < h.size(); ++i) out[i / dslope_slots] += h[i];
    return out;
  };
  const std::vector<double> dbias = read_dbias(), dslopes = read_dslopes();
  // The Hopper backward on the same inputs, its outputs poisoned again.
  bool hopper = false;
  std::vector<double> dbias90, dslopes90;
  bool reproducible90 = true;
  std::vector<uint16_t> h_dq90(o_elems), h_dk90(k.size()), h_dv90(v.size());
#ifdef JFA_CHECK_SM90
  if (hopper_device() && jfa::sm90::can_implement_backward(p)) {
    hopper = true;
    CK(cudaMemset(d_dq, 0xFF, o_elems * 2)); CK(cudaMemset(d_dk, 0xFF, k.size() * 2));
    CK(cudaMemset(d_dv, 0xFF, v.size() * 2)); CK(cudaMemset(d_dqacc, 0xFF, acc_elems * 4));
    CK(cudaMemset(d_D, 0xFF, 2 * stat_rows * 4));
    if (d_dkvacc != nullptr)
      CK(cudaMemset(d_dkvacc, 0xFF, size_t(2) * c.B * c.K * p.dkv_accum_rows() * p.accum_cols * 4));
    if (d_dbias != nullptr) CK(cudaMemset(d_dbias, 0xFF, fd.bias.size() * 4));  // NaN: it must zero them
    if (d_dslopes != nullptr) CK(cudaMemset(d_dslopes, 0xFF, size_t(c.B) * c.N * dslope_slots * 4));
    p.lse_log2 = d_D + stat_rows;
    CK(jfa::sm90::backward(p, stream));
    CK(cudaStreamSynchronize(stream));
    p.lse_log2 = nullptr;
    CK(cudaMemcpy(h_dq90.data(), d_dq, o_elems * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h_dk90.data(), d_dk, k.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h_dv90.data(), d_dv, v.size() * 2, cudaMemcpyDeviceToHost));
    dbias90 = read_dbias();
    dslopes90 = read_dslopes();
    if (c.f.deterministic) {  // the Hopper backward's ordered dQ adds: the same bits again
      p.lse_log2 = d_D + stat_rows;
      CK(jfa::sm90::backward(p, stream));
      CK(cudaStreamSynchronize(stream));
      p.lse_log2 = nullptr;
      std::vector<uint16_t> again(o_elems);
      CK(cudaMemcpy(again.data(), d_dq, o_elems * 2, cudaMemcpyDeviceToHost));
      reproducible90 = std::memcmp(again.data(), h_dq90.data(), o_elems * 2) == 0;
    }
  }
#endif

  Ref ref = reference(c, q, k, v, dout, dlse, scale, hp);
  const int range_misses = p.mask.active() ? check_ranges(c, hp) : 0;
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
  // Empty rows: -inf in both is a match (compared as 0); -inf in one only is a failure (NaN).
  for (size_t i = 0; i < lse.size(); ++i) {
    const bool a = lse[i] == -INFINITY, b = ref.lse[i] == -INFINITY;
    if (a && b) lse[i] = ref.lse[i] = 0;
    else if (a || b) lse[i] = NAN;
  }
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
  for (int i = 0; i < (g_hopper_only ? 2 : 5); ++i) ok = ok && fin[i] && (e[i] <= tols[i] || ma[i] <= abs_tol);
  // d(bias) and d(slopes) of one backward against the reference; their errors into e_db, e_ds and
  // e_ds_terms (the error over its terms' magnitudes).
  auto extras_ok = [&](const std::vector<double>& db, const std::vector<double>& dsl, double& e_db, double& e_ds,
                       double& e_ds_terms) {
    bool good = true;
    double ma_db = 0, ma_ds = 0;
    bool fin_db = true, fin_ds = true;
    e_db = e_ds = e_ds_terms = 0;
    if (!db.empty()) {
      e_db = rel_err(db, ref.dbias, &ma_db, &fin_db);
      good = good && fin_db && (e_db <= 4 * tol || ma_db <= abs_tol);
    }
    if (!dsl.empty()) {
      e_ds = rel_err(dsl, ref.dslopes, &ma_ds, &fin_ds);
      // d(slope) = -sum dS·|pos - j| over a head: its terms cancel to about 1e-3 of the sum of their
      // magnitudes, so small errors of dS (soft-capping's tanh.approx moves every logit a little,
      // the same way for equal inputs) read large in the relative test. Such a value also passes
      // within 1e-3 of its terms' magnitudes with soft-capping, 2e-4 without.
      const double terms_tol = c.f.softcap > 0.f ? 1e-3 : 2e-4;
      bool within_terms = true;
      for (size_t i = 0; i < dsl.size(); ++i) {
        const double err = std::fabs(dsl[i] - ref.dslopes[i]);
        within_terms = within_terms && err <= 4 * tol * std::fabs(ref.dslopes[i]) + terms_tol * ref.dslopes_l1[i];
        e_ds_terms = std::max(e_ds_terms, err / std::max(ref.dslopes_l1[i], 1e-30));
      }
      good = good && fin_ds && (e_ds <= 4 * tol || ma_ds <= abs_tol || within_terms);
      if (!good)
        for (size_t i = 0; i < dsl.size(); ++i)
          printf("[dslopes %zu: %.6g, reference %.6g, sum of |terms| %.6g] ", i, dsl[i], ref.dslopes[i],
                 ref.dslopes_l1[i]);
    }
    return good;
  };
  double e_db = 0, e_ds = 0, e_ds_terms = 0;
  if (!g_hopper_only) ok = extras_ok(dbias, dslopes, e_db, e_ds, e_ds_terms) && ok;
  ok = ok && range_misses == 0 && reproducible;
  if (!ok) ++g_failures;
  if (!reproducible) printf("[deterministic: dq differs between two runs] ");
  if (c.f.name != nullptr)
    printf("[%s%s dbias %.2e dslopes %.2e (%.1e of its terms), range misses %d] ", c.f.name,
           c.f.dropout > 0.f ? " dropout" : "", e_db, e_ds, e_ds_terms, range_misses);
  printf("%s %s B=%d T=%d S=%d N=%d K=%d H=%d causal=%d dlse=%d pad=%d | rel o %.2e lse %.2e dq %.2e dk %.2e dv %.2e | maxabs dq %.1e dk %.1e%s\n",
         ok ? "PASS" : "FAIL", dtn, c.B, c.T, c.S, c.N, c.K, c.H, c.causal, c.dlse, c.pad, e[0], e[1], e[2], e[3], e[4], ma[2], ma[3],
         (fin[0] && fin[1] && fin[2] && fin[3] && fin[4]) ? "" : " NONFINITE");
  fflush(stdout);
  if (hopper) {
    const std::vector<double> dq90 = gather(h_dq90, o_layout), dk90 = gather(h_dk90, k), dv90 = gather(h_dv90, v);
    double m90[3];
    bool f90[3];
    const double e90[3] = {rel_err(dq90, ref.dq, &m90[0], &f90[0]), rel_err(dk90, ref.dk, &m90[1], &f90[1]),
                           rel_err(dv90, ref.dv, &m90[2], &f90[2])};
    bool ok90 = true;
    for (int i = 0; i < 3; ++i) ok90 = ok90 && f90[i] && (e90[i] <= 4 * tol || m90[i] <= abs_tol);
    ok90 = extras_ok(dbias90, dslopes90, e_db, e_ds, e_ds_terms) && ok90 && reproducible90;
    if (!reproducible90) printf("[deterministic: the Hopper backward's dq differs between two runs] ");
    if (!ok90) ++g_failures;
    if (c.f.name != nullptr)
      printf("[%s%s dbias %.2e dslopes %.2e (%.1e of its terms)] ", c.f.name, c.f.dropout > 0.f ? " dropout" : "",
             e_db, e_ds, e_ds_terms);
    printf("%s sm90-bwd %s B=%d T=%d S=%d N=%d K=%d H=%d causal=%d dlse=%d pad=%d | rel dq %.2e dk %.2e dv %.2e | maxabs dq %.1e dk %.1e%s\n",
           ok90 ? "PASS" : "FAIL", dtn, c.B, c.T, c.S, c.N, c.K, c.H, c.causal, c.dlse, c.pad, e90[0], e90[1], e90[2],
           m90[0], m90[1], (f90[0] && f90[1] && f90[2]) ? "" : " NONFINITE");
    fflush(stdout);
  }
  CK(cudaStreamDestroy(stream));
  for (void* ptr : {(void*)p.q, (void*)p.k, (void*)p.v, (void*)p.dout, d_o, d_dq, d_dk, d_dv, (void*)d_lse, (void*)d_dlse,
                    (void*)d_dqacc, (void*)d_D})
    CK(cudaFree(ptr));
  for (void* ptr : feature_bufs) CK(cudaFree(ptr));
  if (d_dbias != nullptr) CK(cudaFree(d_dbias));
  if (d_dslopes != nullptr) CK(cudaFree(d_dslopes));
  if (d_sem != nullptr) CK(cudaFree(d_sem));
  if (d_dkvacc != nullptr) CK(cudaFree(d_dkvacc));
}

static void bench(DType dt, int H, int B, int T, int N, bool causal, bool hopper_only = false, int K = 0) {
  if (!jfa::sm80::is_built(dt, H)) return;
  const int S = T;
  if (K == 0) K = N;
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
  const size_t acc_rows = size_t(jfa::kDqLanes) * B * N * p.dq_accum_rows();  // every lane of the deterministic run
  const size_t stat_rows = size_t(B) * N * p.dq_accum_rows();
  p.accum_cols = accum_cols(H);
  CK(cudaMalloc(&lse, rows * 4)); CK(cudaMalloc(&dqacc, acc_rows * p.accum_cols * 4));
  CK(cudaMalloc(&D, 2 * stat_rows * 4));
  auto st = jfa::packed_strides(T, N, H);
  p.q = bufs[0]; p.k = bufs[1]; p.v = bufs[2]; p.o = bufs[3]; p.dout = bufs[4];
  p.dq = bufs[5]; p.dk = bufs[6]; p.dv = bufs[7];
  p.q_strides = p.o_strides = p.do_strides = p.dq_strides = st;
  p.k_strides = p.v_strides = p.dk_strides = p.dv_strides = jfa::packed_strides(S, K, H);
  p.lse = lse; p.lse_strides = jfa::Strides{int64_t(T) * N, N, 1};
  p.dq_accum = dqacc; p.softmax_d = D;
  float* dkvacc = nullptr;
  if (N > K) {
    CK(cudaMalloc(&dkvacc, size_t(2) * B * K * p.dkv_accum_rows() * p.accum_cols * 4));
    p.dkv_accum = dkvacc;
  }
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  // What `time` runs: 0 the forward, 1 the backward, 2 the Hopper backward.
  auto run = [&](int what) {
#ifdef JFA_CHECK_SM90
    if (what == 2) return jfa::sm90::backward(p, s);
#endif
    return what == 1 ? jfa::sm80::backward(p, s) : jfa::sm80::forward(p, s);
  };
  auto time = [&](int what) {
    for (int i = 0; i < 3; ++i) CK(run(what));
    std::vector<float> ms;
    for (int r = 0; r < 10; ++r) {
      CK(cudaEventRecord(e0, s));
      CK(run(what));
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
  double flops = 4.0 * B * double(T) * S * N * H * (causal ? 0.5 : 1.0);
#ifdef JFA_CHECK_SM90
  if (hopper_only) {
    p.lse_log2 = D + stat_rows;
    const float tb90 = time(2);
    printf("BENCH sm90-bwd %s H=%d B=%d T=S=%d N=%d K=%d causal=%d | bwd %.3f ms %.1f TFLOP/s\n",
           dt == DType::kBFloat16 ? "bf16" : "fp16", H, B, T, N, K, causal, tb90, 2.5 * flops / tb90 * 1e-9);
  }
#endif
  if (hopper_only) {
    for (int i = 0; i < 8; ++i) CK(cudaFree(bufs[i]));
    CK(cudaFree(lse)); CK(cudaFree(dqacc)); CK(cudaFree(D));
    if (dkvacc != nullptr) CK(cudaFree(dkvacc));
    CK(cudaStreamDestroy(s));
    return;
  }
  const float tf = time(0), tb = time(1);
  // The deterministic backward (ordered dQ adds) on the same problem.
  int32_t* sem;
  CK(cudaMalloc(&sem, size_t(jfa::kDqLanes) * B * N * p.dq_semaphores_per_head() * 4));
  p.deterministic = true;
  p.dq_semaphore = sem;
  const float tb_det = time(1);
  p.deterministic = false;
  CK(cudaFree(sem));
#ifdef JFA_CHECK_SM90
  if (hopper_device() && jfa::sm90::can_implement_backward(p)) {
    p.lse_log2 = D + stat_rows;
    const float tb90 = time(2);
    p.lse_log2 = nullptr;
    printf("BENCH sm90-bwd %s H=%d B=%d T=S=%d N=%d causal=%d | bwd %.3f ms %.1f TFLOP/s (sm80 %.3f ms) | fwd+bwd %.1f TFLOP/s\n",
           dt == DType::kBFloat16 ? "bf16" : "fp16", H, B, T, N, causal, tb90, 2.5 * flops / tb90 * 1e-9, tb,
           3.5 * flops / (tf + tb90) * 1e-9);
  }
#endif
  printf("BENCH %s H=%d B=%d T=S=%d N=%d causal=%d | fwd %.3f ms %.1f TFLOP/s | bwd %.3f ms %.1f TFLOP/s | fwd+bwd %.1f TFLOP/s"
         " | deterministic bwd %.3f ms %.1f TFLOP/s\n",
         dt == DType::kBFloat16 ? "bf16" : "fp16", H, B, T, N, causal, tf, flops / tf * 1e-9, tb, 2.5 * flops / tb * 1e-9,
         3.5 * flops / (tf + tb) * 1e-9, tb_det, 2.5 * flops / tb_det * 1e-9);
  fflush(stdout);
  for (int i = 0; i < 8; ++i) CK(cudaFree(bufs[i]));
  CK(cudaFree(lse)); CK(cudaFree(dqacc)); CK(cudaFree(D));
  if (dkvacc != nullptr) CK(cudaFree(dkvacc));
  CK(cudaStreamDestroy(s));
}

int main(int argc, char** argv) {
  const bool small = argc > 1 && std::string(argv[1]) == "--small";
  g_hopper_only = argc > 2 && std::string(argv[2]) == "--hopper-only";
  const bool bench_hopper = argc > 3 && std::string(argv[1]) == "--bench-hopper";
  const bool bench_only = bench_hopper || (argc > 1 && std::string(argv[1]) == "--bench");
  printf("built: %s\n", jfa::sm80::built_variants());
  // A fresh seed each run; JFA_CHECK_SEED=<seed> replays a run (each case: below).
  const char* seed_env = std::getenv("JFA_CHECK_SEED");
  const unsigned seed = seed_env != nullptr ? unsigned(std::strtoul(seed_env, nullptr, 10)) : std::random_device{}();
  printf("seed: %u\n", seed);
  std::vector<Config> cases;
  const DType BF = DType::kBFloat16, FP = DType::kFloat16;
  if (small) {
    for (int H : {64, 128, 256})
      for (bool causal : {false, true}) {
        cases.push_back({1, 17, 17, 2, 1, H, causal, BF, true, 0});
        cases.push_back({1, 70, 130, 2, 2, H, causal, FP, false, 8});
        cases.push_back({1, 130, 65, 4, 2, H, causal, BF, true, 0});
      }
    for (int H : {32, 96, 192}) {  // on sm90: the next wider Hopper kernel (sm90/api.h)
      cases.push_back({1, 70, 90, 2, 1, H, true, BF, true, 0});
      cases.push_back({1, 130, 65, 4, 2, H, true, BF, true, 0});  // causal GQA: the dK/dV workspace
    }
  } else if (!bench_only) {
    const int TS[][2] = {{1, 1}, {17, 17}, {255, 255}, {1000, 1000}, {17, 255}, {255, 17}, {1000, 255}, {1, 1000}, {255, 1}};
    for (DType dt : {BF, FP})
      for (int H : {64, 128})
        for (bool causal : {false, true})
          for (auto& ts : TS) {
            const bool big = ts[0] >= 1000 || ts[1] >= 1000;
            cases.push_back({big ? 1 : 2, ts[0], ts[1], 2, 2, H, causal, dt, (ts[0] + ts[1]) % 2 == 0, 0});
          }
    // Around the Hopper backward's tiles (64, 80 or 128 queries by 128 keys; 64 by 64 at H 256):
    // sequences ending just inside, on and just past a tile edge, a key block no query sees
    // (causal, S > T).
    for (DType dt : {BF, FP})
      for (int H : {64, 128, 256})
        for (bool causal : {false, true}) {
          cases.push_back({1, 129, 127, 2, 1, H, causal, dt, true, 0});
          cases.push_back({2, 64, 384, 2, 2, H, causal, dt, false, 0});
          cases.push_back({1, 513, 257, 3, 3, H, causal, dt, true, 8});
        }
    for (DType dt : {BF, FP}) {  // H 128 without causality: 80-query blocks
      cases.push_back({1, 80, 200, 2, 1, 128, false, dt, true, 0});
      cases.push_back({2, 161, 129, 4, 2, 128, false, dt, false, 8});
      cases.push_back({1, 239, 77, 2, 2, 128, false, dt, true, 0});
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
  // The general path, one feature at a time and all at once (B = 2 so lengths differ per batch).
  {
    std::vector<Features> fs;
    auto add = [&](const char* name, auto set) {
      Features f;
      f.name = name;
      set(f);
      fs.push_back(f);
    };
    add("lengths", [](Features& f) { f.q_lengths = f.kv_lengths = true; });
    add("empty", [](Features& f) { f.q_lengths = f.empty_batch = true; });
    add("window", [](Features& f) { f.window_left = 40; f.window_right = 7; });
    add("window_left", [](Features& f) { f.window_left = 70; });
    add("bottom_right", [](Features& f) { f.bottom_right = true; });
    add("segments", [](Features& f) { f.segments = true; });
    add("softcap", [](Features& f) { f.softcap = 1.5f; });
    add("alibi", [](Features& f) { f.alibi = true; f.bottom_right = true; });
    add("bias_full", [](Features& f) { f.bias = 1; });
    add("bias_1N1S", [](Features& f) { f.bias = 2; });
    add("bias_B1T1", [](Features& f) { f.bias = 3; });
    add("mask", [](Features& f) { f.mask = true; });
    add("dropout", [](Features& f) { f.dropout = 0.2f; });
    add("all", [](Features& f) {
      f.bottom_right = f.q_lengths = f.kv_lengths = f.segments = f.alibi = f.mask = true;
      f.window_left = 90; f.window_right = 20; f.softcap = 2.f; f.bias = 1; f.dropout = 0.1f;
    });
    const Features all_features = fs.back();
    add("deterministic", [](Features& f) { f.deterministic = true; });
    add("deterministic_all", [](Features& f) {
      f.bottom_right = f.q_lengths = f.kv_lengths = f.segments = f.alibi = f.deterministic = true;
      f.window_left = 90; f.window_right = 20; f.softcap = 2.f; f.bias = 1; f.dropout = 0.1f;
    });
    if (small) {
      for (const Features& f : fs)
        for (bool causal : {false, true}) cases.push_back({2, 70, 90, 2, 1, 64, causal, BF, true, 0, f});
      Features all = all_features;
      cases.push_back({2, 130, 65, 4, 2, 128, true, FP, true, 8, all});
      // The Hopper backward's other layouts with every feature, and its ordered dQ adds.
      cases.push_back({1, 70, 90, 2, 1, 256, false, BF, true, 0, all});
      for (int H : {128, 256}) cases.push_back({2, 130, 200, 4, 2, H, true, BF, true, 0, fs.back()});
      cases.push_back({2, 170, 200, 4, 2, 128, false, BF, true, 0, fs[fs.size() - 2]});  // ordered, 80-query blocks
    } else if (!bench_only) {
      for (const Features& f : fs)
        for (bool causal : {false, true}) {
          cases.push_back({2, 255, 300, 4, 2, 128, causal, BF, true, 0, f});
          cases.push_back({2, 300, 130, 2, 1, 64, causal, FP, false, 8, f});
          cases.push_back({2, 130, 200, 2, 1, 256, causal, BF, true, 0, f});  // the split-head layout
        }
      for (int H : {32, 96, 192, 256}) cases.push_back({2, 255, 300, 2, 1, H, true, BF, true, 0, all_features});
      cases.push_back({1, 1000, 1000, 2, 2, 128, true, BF, true, 0, all_features});
      // The ordered kernels with 8 key tiles per head on 4 (batch, kv head) pairs.
      Features ordered;
      ordered.name = "deterministic_8_key_tiles";
      ordered.deterministic = true;
      for (bool causal : {false, true}) cases.push_back({2, 1000, 1000, 4, 2, 128, causal, BF, true, 0, ordered});
    }
  }
  // JFA_CHECK_CASES=<feature name> keeps the general-path cases of that feature only, each run
  // JFA_CHECK_REPEAT times (default 1) on fresh inputs: for chasing a rare failure.
  if (const char* only = std::getenv("JFA_CHECK_CASES")) {
    const char* repeat_env = std::getenv("JFA_CHECK_REPEAT");
    const int repeat = repeat_env != nullptr ? std::max(1, std::atoi(repeat_env)) : 1;
    std::vector<Config> kept;
    for (const Config& c : cases)
      if (c.f.name != nullptr && std::string(c.f.name) == only)
        for (int r = 0; r < repeat; ++r) kept.push_back(c);
    cases = kept;
  }
  // Each case draws from its own stream, so that JFA_CHECK_SEED replays a case whatever else the
  // build holds (cases of unbuilt variants are skipped).
  for (size_t i = 0; i < cases.size(); ++i) {
    std::mt19937 case_rng(seed ^ (0x9E3779B9u * unsigned(i + 1)));
    run_case(cases[i], case_rng);
  }
  if (bench_hopper) {
    const int H = std::atoi(argv[2]), T = argc > 4 ? std::atoi(argv[4]) : 16384;
    const int N = argc > 5 ? std::atoi(argv[5]) : 16 * 128 / H, K = argc > 6 ? std::atoi(argv[6]) : N;
    bench(BF, H, std::max(1, 16384 / T), T, N, std::atoi(argv[3]) != 0, true, K);
  } else if (bench_only && argc > 3) {
    const int H = std::atoi(argv[2]);
    bench(BF, H, 1, 16384, 16 * 128 / H, std::atoi(argv[3]) != 0);
  } else if (!small && std::getenv("JFA_CHECK_CASES") == nullptr) {
    bench(BF, 128, 1, 16384, 16, false);
    bench(BF, 128, 1, 16384, 16, true);
    bench(BF, 64, 1, 16384, 32, false);
    bench(BF, 64, 1, 16384, 32, true);
    bench(BF, 256, 1, 16384, 8, false);
    bench(BF, 256, 1, 16384, 8, true);
  }
  printf("%d failures\n", g_failures);
  return g_failures ? 1 : 0;
}
